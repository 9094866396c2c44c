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
    # Training pods: CDK's read/write grant on the bucket's two linked prefixes.
    *{("mltrain-storage/TrainerRole", f"AwsSolutions::AwsSolutions-IAM5[{finding}]") for finding in (
        "Action::s3:Abort*", "Action::s3:DeleteObject*", "Action::s3:GetBucket*", "Action::s3:GetObject*",
        "Action::s3:List*", "Resource::<DataBucketE6B0FAA8.Arn>/checkpoints/*",
        "Resource::<DataBucketE6B0FAA8.Arn>/datasets/*")},
    # Add-on roles with the AWS-managed policies the add-ons document.
    ("mltrain-cluster/Addons/CloudWatchAgent/Role",
     "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/CloudWatchAgentServerPolicy]"),
    ("mltrain-cluster/Addons/VpcCni/Role",
     "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/AmazonEKS_CNI_Policy]"),
    ("mltrain-cluster/Addons/EbsCsi/Role",
     "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy]"),
    # Keeping the autoscaler's node counts: read this cluster's node groups, write its own logs.
    ("mltrain-cluster/NodegroupDesiredSizeRole",
     "AwsSolutions::AwsSolutions-IAM5[Resource::arn:aws:eks:us-west-2:<AWS::AccountId>:nodegroup/<ClusterEB0386A7>/*/*]"),
    ("mltrain-cluster/NodegroupDesiredSizeRole",
     "AwsSolutions::AwsSolutions-IAM5[Resource::<NodegroupDesiredSizeLogs2162153F.Arn>:*]"),
    # Controllers whose Describe calls have no resource-level permissions.
    ("mltrain-cluster/Charts/AutoscalerIdentity/Role", "AwsSolutions::AwsSolutions-IAM5[Resource::*]"),
    # Scale from zero: tagging each group's Auto Scaling group, whose name has a random part.
    *{(f"mltrain-cluster/Group-{g}/TagAutoScalingGroup",
       f"AwsSolutions::AwsSolutions-IAM5[Resource::arn:aws:autoscaling:us-west-2:<AWS::AccountId>:autoScalingGroup:"
       f"*:autoScalingGroupName/eks-<Group{g}Nodegroup{suffix}.NodegroupName>-*]")
      for g, suffix in (("p4d", "1BED6FE0"), ("trn1", "F787AE98"))},
    # aws-cdk-lib's own cluster role, kubectl provider and custom-resource Lambda.
    ("mltrain-cluster/Cluster/Role",
     "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/AmazonEKSClusterPolicy]"),
    *{("mltrain-cluster/Cluster/KubectlProvider",
       f"AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{p}]")
      for p in ("AmazonEC2ContainerRegistryReadOnly", "service-role/AWSLambdaBasicExecutionRole",
                "service-role/AWSLambdaVPCAccessExecutionRole")},
    ("mltrain-cluster/Cluster/KubectlProvider",
     'AwsSolutions::AwsSolutions-IAM4[Policy::{"Fn::If":["ClusterKubectlProviderHandlerHasEcrPublic69E09706",'
     '{"Fn::Join":["",["arn:",{"Ref":"AWS::Partition"},":iam::aws:policy/AmazonElasticContainerRegistryPublicReadOnly"]]},'
     '{"Ref":"AWS::NoValue"}]}]'),
    ("mltrain-cluster/Cluster/KubectlProvider",
     "AwsSolutions::AwsSolutions-IAM5[Resource::<ClusterKubectlProviderHandler2E05C68A.Arn>:*]"),
    ("mltrain-cluster/Cluster/KubectlProvider", "AwsSolutions::AwsSolutions-L1"),
    ("mltrain-cluster/AWS679f53fac002430cb0da5b7982bd2287",
     "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole]"),
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
