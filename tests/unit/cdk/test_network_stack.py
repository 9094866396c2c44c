"""Assertions on the properties of the network that matter."""

from __future__ import annotations

import pytest
from aws_cdk.assertions import Match

from tests.conftest import VARIANTS


@pytest.fixture(scope="module")
def example(synth):
    return synth(VARIANTS["example"])


def subnets(template):
    return template.find_resources("AWS::EC2::Subnet")


def test_vpc_cidr_and_two_azs(example):
    t = example.template(example.platform.network)
    t.has_resource_properties("AWS::EC2::VPC", {"CidrBlock": "10.0.0.0/16"})
    azs = sorted({s["Properties"]["AvailabilityZone"] for s in subnets(t).values()})
    assert azs == ["us-west-2a", "us-west-2b"]


def test_exactly_one_private_compute_subnet_and_it_is_the_output(example):
    t = example.template(example.platform.network)
    private_in_compute_az = [
        logical_id
        for logical_id, s in subnets(t).items()
        if s["Properties"]["AvailabilityZone"] == "us-west-2a" and not s["Properties"]["MapPublicIpOnLaunch"]
    ]
    assert len(private_in_compute_az) == 1
    assert t.find_outputs("ComputeSubnetId")["ComputeSubnetId"]["Value"] == {"Ref": private_in_compute_az[0]}
    compute = example.platform.network.network.compute_subnet
    assert compute.availability_zone == "us-west-2a"


def test_private_subnets_route_through_nat(example):
    t = example.template(example.platform.network)
    t.resource_count_is("AWS::EC2::NatGateway", 1)
    t.resource_properties_count_is("AWS::EC2::Route", {"NatGatewayId": Match.any_value()}, 2)


def test_flow_logs_capture_all_traffic(example):
    t = example.template(example.platform.network)
    t.has_resource_properties("AWS::EC2::FlowLog", {"ResourceType": "VPC", "TrafficType": "ALL"})
    t.has_resource("AWS::Logs::LogGroup", {"Properties": {"RetentionInDays": 90}, "DeletionPolicy": "Retain"})


def test_s3_gateway_and_interface_endpoints(example):
    t = example.template(example.platform.network)
    endpoints = t.find_resources("AWS::EC2::VPCEndpoint")
    kinds = sorted(e["Properties"].get("VpcEndpointType", "Gateway") for e in endpoints.values())
    assert kinds == ["Gateway"] + ["Interface"] * 5
    services = sorted(str(e["Properties"]["ServiceName"]) for e in endpoints.values())
    for name in ("ecr.api", "ecr.dkr", "sts", "logs", "ec2", "s3"):
        assert any(name in s for s in services), name


def test_endpoint_security_group_admits_https_from_the_vpc_only(example):
    t = example.template(example.platform.network)
    t.has_resource_properties(
        "AWS::EC2::SecurityGroup",
        {
            "SecurityGroupIngress": [
                {"CidrIp": "10.0.0.0/16", "FromPort": 443, "ToPort": 443, "IpProtocol": "tcp", "Description": Match.any_value()}
            ]
        },
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_ingress_from_the_internet(synth, variant):
    result = synth(VARIANTS[variant])
    for stack in result.platform.stacks:
        t = result.template(stack)
        rules = [
            rule
            for sg in t.find_resources("AWS::EC2::SecurityGroup").values()
            for rule in sg["Properties"].get("SecurityGroupIngress", [])
        ] + [r["Properties"] for r in t.find_resources("AWS::EC2::SecurityGroupIngress").values()]
        assert all(r.get("CidrIp") != "0.0.0.0/0" and r.get("CidrIpv6") != "::/0" for r in rules)


def test_node_security_group_passes_all_traffic_to_and_from_itself_only(example):
    """EFA needs all traffic within the group, both ways; and nothing else may be opened here."""
    t = example.template(example.platform.network)
    (sg_id,) = t.find_resources("AWS::EC2::SecurityGroup",
                                {"Properties": {"GroupDescription": Match.string_like_regexp("^Worker nodes")}})
    own = {"Fn::GetAtt": [sg_id, "GroupId"]}
    ingress = [r["Properties"] for r in t.find_resources("AWS::EC2::SecurityGroupIngress").values()
               if r["Properties"]["GroupId"] == own]
    egress = [r["Properties"] for r in t.find_resources("AWS::EC2::SecurityGroupEgress").values()
              if r["Properties"]["GroupId"] == own]
    assert [(r["IpProtocol"], r["SourceSecurityGroupId"]) for r in ingress] == [("-1", own)]
    assert [(r["IpProtocol"], r["DestinationSecurityGroupId"]) for r in egress] == [("-1", own)]
    # Nothing inline; CloudFormation drops the default allow-all egress once the rule above exists.
    inline = set(t.find_resources("AWS::EC2::SecurityGroup")[sg_id]["Properties"])
    assert not {"SecurityGroupIngress", "SecurityGroupEgress"} & inline
    assert "NodeSecurityGroupId" in t.find_outputs("*")


def test_endpoints_can_be_turned_off(synth):
    result = synth(VARIANTS["no-endpoints"])
    t = result.template(result.platform.network)
    t.resource_properties_count_is("AWS::EC2::VPCEndpoint", {"VpcEndpointType": "Interface"}, 0)
    t.resource_count_is("AWS::EC2::VPCEndpoint", 1)


def test_config_tags_reach_resources(example):
    t = example.template(example.platform.network)
    t.has_resource_properties(
        "AWS::EC2::VPC",
        {"Tags": Match.array_with([{"Key": "platform", "Value": "mltrain"}, {"Key": "project", "Value": "elastic-training"}])},
    )


def test_pinned_account_uses_the_preseeded_az_lookup(synth):
    result = synth(VARIANTS["pinned-account"])
    assert result.platform.network.account == "123456789012"
    t = result.template(result.platform.network)
    azs = sorted({s["Properties"]["AvailabilityZone"] for s in subnets(t).values()})
    assert azs == ["us-west-2a", "us-west-2b"]
