"""cdk-nag is live: a real finding fails synth, and only an acknowledgement with a reason clears it."""

from __future__ import annotations

import pytest
from aws_cdk import Acknowledgment, App, Stack, Validations, aws_ec2 as ec2

from stacks.platform import add_policy_checks
from tests.conftest import VARIANTS


def _open_security_group_app(tmp_path, acknowledge: bool) -> App:
    app = App(outdir=str(tmp_path))
    stack = Stack(app, "Probe")
    vpc = ec2.Vpc(stack, "Vpc", max_azs=1, nat_gateways=0, subnet_configuration=[
        ec2.SubnetConfiguration(name="isolated", subnet_type=ec2.SubnetType.PRIVATE_ISOLATED)
    ])
    vpc.add_flow_log("FlowLog")
    sg = ec2.SecurityGroup(stack, "Open", vpc=vpc, description="probe")
    sg.add_ingress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(22))
    if acknowledge:
        Validations.of(sg).acknowledge(
            Acknowledgment(id="AwsSolutions::AwsSolutions-EC23", reason="probe for the test harness")
        )
    add_policy_checks(app)
    return app


def test_unacknowledged_finding_fails_synth(tmp_path):
    with pytest.raises(Exception, match="ValidationFailed"):
        _open_security_group_app(tmp_path, acknowledge=False).synth()
    assert "AwsSolutions-EC23" in (tmp_path / "validation-report.json").read_text()


def test_acknowledged_finding_passes(tmp_path):
    _open_security_group_app(tmp_path, acknowledge=True).synth()


# Every cdk-nag finding the platform accepts, where, and why it is in this list. A new
# acknowledgement must be added here on purpose, so a reviewer sees it in the diff.
REVIEWED_ACKNOWLEDGEMENTS = {
    ("mltrain-storage/Data/AccessLogs", "AwsSolutions::AwsSolutions-S1"),
    (
        "mltrain-registry/Nodes/Role",
        "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/AmazonEKSWorkerNodePolicy]",
    ),
    (
        "mltrain-registry/Nodes/Role",
        "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/AmazonEC2ContainerRegistryPullOnly]",
    ),
    ("mltrain-registry/Nodes/Role", "AwsSolutions::AwsSolutions-IAM5[Resource::*]"),
}


def test_platform_acknowledges_only_reviewed_findings_each_with_a_reason(synth):
    app = synth(VARIANTS["example"]).platform.network.node.scope
    found = {}
    for construct in app.node.find_all():
        for entry in construct.node.metadata:
            if entry.type == Validations.ACKNOWLEDGED_RULES_METADATA_KEY:
                for rule, reason in entry.data.items():
                    if rule.startswith("AwsSolutions::"):
                        found[(construct.node.path, rule)] = reason
    assert set(found) == REVIEWED_ACKNOWLEDGEMENTS
    assert all(len(reason) > 30 for reason in found.values())
