"""The accelerated node group construct: one subnet, labels and taint, and tags for scale from zero."""

from __future__ import annotations

import json

import pytest
from aws_cdk import App, Stack, aws_ec2 as ec2, aws_eks_v2 as eks, aws_iam as iam
from aws_cdk.assertions import Match, Template

from cdk_constructs.accelerated_node_group import AcceleratedNodeGroup, autoscaler_template_tags
from cdk_constructs.node_version import NodeVersion
from config import AcceleratedNodeGroupConfig, lookup
from stacks.cluster_stack import accelerated_node_group_props
from training.contract import NODE_CHECK_TAINT


def group(instance_type: str, **extra) -> AcceleratedNodeGroupConfig:
    return AcceleratedNodeGroupConfig(name="g", instance_type=instance_type, min_size=0, desired_size=0,
                                      max_size=4, **extra)


def synth(config: AcceleratedNodeGroupConfig, node_check: bool = True) -> tuple[Template, Stack, ec2.ISubnet]:
    stack = Stack(App(), "Test", env={"account": "123456789012", "region": "us-west-2"})
    vpc = ec2.Vpc(stack, "Vpc", max_azs=2, nat_gateways=1)
    cluster = eks.Cluster(stack, "Cluster", version=eks.KubernetesVersion.of("1.34"), vpc=vpc,
                          default_capacity_type=eks.DefaultCapacityType.NODEGROUP, default_capacity=0)
    subnet = vpc.private_subnets[0]
    role = iam.Role(stack, "NodeRole", assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"))
    sg = ec2.SecurityGroup(stack, "NodeSg", vpc=vpc)
    AcceleratedNodeGroup(stack, "P4d", accelerated_node_group_props(
        config, cluster=cluster, subnet=subnet, node_role=role, node_security_group=sg,
        version=NodeVersion("1.34"), node_check=node_check))
    return Template.from_stack(stack), stack, subnet


def test_the_node_group_uses_only_the_compute_subnet_with_labels_and_taint():
    template, stack, subnet = synth(group("p4d.24xlarge"))
    props = next(iter(template.find_resources("AWS::EKS::Nodegroup").values()))["Properties"]
    assert props["Subnets"] == [stack.resolve(subnet.subnet_id)]
    assert props["AmiType"] == "AL2023_x86_64_NVIDIA" and props["ScalingConfig"]["MinSize"] == 0
    assert props["Labels"]["vpc.amazonaws.com/efa.present"] == "true"
    assert props["Taints"] == [{"Effect": "NO_SCHEDULE", "Key": "nvidia.com/gpu", "Value": "true"},
                               {"Effect": "NO_SCHEDULE", "Key": NODE_CHECK_TAINT, "Value": "pending"}]
    assert "InstanceTypes" not in props  # the launch template names the type
    template.has_resource_properties("AWS::EC2::LaunchTemplate", {"LaunchTemplateData": Match.object_like(
        {"InstanceType": "p4d.24xlarge"})})
    template.has_resource_properties("AWS::EC2::PlacementGroup", {"Strategy": "cluster"})


def test_without_the_node_check_nodes_join_with_their_accelerators_taint_alone():
    template, _, _ = synth(group("p4d.24xlarge"), node_check=False)
    props = next(iter(template.find_resources("AWS::EKS::Nodegroup").values()))["Properties"]
    assert props["Taints"] == [{"Effect": "NO_SCHEDULE", "Key": "nvidia.com/gpu", "Value": "true"}]
    # cluster-autoscaler drops startup taints from its templates itself: the group's template tags never carry it
    tags = autoscaler_template_tags("p4d", lookup("p4d.24xlarge"), efa=True)
    assert not any(NODE_CHECK_TAINT in key for key in tags)


def test_node_auto_repair_is_on_by_default_and_off_is_said_to_eks():
    template, _, _ = synth(group("p5.48xlarge"))
    template.has_resource_properties("AWS::EKS::Nodegroup", {"NodeRepairConfig": {"Enabled": True}})
    template, _, _ = synth(group("p5.48xlarge", node_auto_repair=False))
    template.has_resource_properties("AWS::EKS::Nodegroup", {"NodeRepairConfig": {"Enabled": False}})


def test_spot_is_passed_through_for_a_group_without_efa_or_placement_group():
    template, _, _ = synth(group("trn1.2xlarge", capacity_type="SPOT", placement_group=False))
    template.has_resource_properties("AWS::EKS::Nodegroup", {"CapacityType": "SPOT",
                                                            "AmiType": "AL2023_x86_64_NEURON"})


def test_the_auto_scaling_group_gets_the_autoscaler_template_tags():
    template, _, _ = synth(group("trn1.32xlarge"))
    calls = [json.dumps(r["Properties"]["Create"]) for r in template.find_resources("Custom::AWS").values()]
    tagging = next(c for c in calls if "createOrUpdateTags" in c)
    for key in ("k8s.io/cluster-autoscaler/node-template/resources/aws.amazon.com/neuron",
                "k8s.io/cluster-autoscaler/node-template/resources/vpc.amazonaws.com/efa",
                "k8s.io/cluster-autoscaler/node-template/taint/aws.amazon.com/neuron"):
        assert key in tagging
    template.has_resource_properties("AWS::IAM::Policy", {"PolicyDocument": {"Statement": Match.array_with([
        Match.object_like({"Action": "autoscaling:CreateOrUpdateTags",
                           "Condition": {"StringEquals": Match.object_like({})}})])}})


@pytest.mark.parametrize(("instance_type", "resources"), [
    ("p4d.24xlarge", {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "4"}),
    ("p5.48xlarge", {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}),
    ("trn1n.32xlarge", {"aws.amazon.com/neuron": "16", "vpc.amazonaws.com/efa": "16"}),
    ("p3.8xlarge", {"nvidia.com/gpu": "4"}),
    ("trn1.2xlarge", {"aws.amazon.com/neuron": "1"}),
])
def test_template_tags_advertise_the_catalogs_devices(instance_type, resources):
    instance = lookup(instance_type)
    tags = autoscaler_template_tags("g", instance, efa=instance.supports_efa)
    prefix = "k8s.io/cluster-autoscaler/node-template/resources/"
    assert {k.removeprefix(prefix): v for k, v in tags.items() if k.startswith(prefix)} == resources
    assert tags["k8s.io/cluster-autoscaler/node-template/label/node.kubernetes.io/instance-type"] == instance_type
