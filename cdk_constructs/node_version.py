"""The Kubernetes version and EKS AMI release a managed node group runs, written on the group itself.

Without ``Version`` in the template a node group keeps the minor it was created with: bumping
the cluster's version updates the control plane and leaves every node behind. The launch
templates here name no AMI (cdk_constructs/efa_launch_template.py), so EKS chooses the EKS
optimized AMI for the group's ``AmiType`` and ``Version``/``ReleaseVersion`` are allowed; with
an AMI in the template they must be left out and the AMI alone fixes the version (EKS API
Reference, CreateNodegroup and UpdateNodegroupVersion, "version" and "releaseVersion").

aws-cdk-lib 2.275.0's ``aws_eks_v2.Nodegroup`` passes ``releaseVersion`` to ``AWS::EKS::Nodegroup``
but has no ``version`` prop (aws-eks-v2/lib/managed-nodegroup.js), so both are set on the L1
resource, in one place for the system and the accelerated groups.

The group names its cluster with a ``Ref``, so CloudFormation updates the control plane before
the group in the same deploy ("Resource B is updated before resource A", DependsOn attribute,
CloudFormation Template Reference). A ``Version`` or ``ReleaseVersion`` update cannot carry any
other change to the group (AWS::EKS::Nodegroup ``Version``: "You can't update other properties at
the same time"; the error CloudFormation reports is "Version and ReleaseVersion updates cannot be
combined with other updates", aws/containers-roadmap#1258), which is why docs/operations.md asks
for version changes in a deploy of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import aws_eks_v2 as eks


@dataclass(frozen=True)
class NodeVersion:
    kubernetes: str  # a minor, e.g. "1.34": the control plane's, or one behind while nodes are held back
    ami_release: str | None = None  # e.g. "1.34.2-20251120"; None: EKS's newest release for the minor


def pin_node_version(nodegroup: eks.Nodegroup, version: NodeVersion) -> None:
    """Write the group's ``Version`` (and ``ReleaseVersion`` when pinned) into its CloudFormation resource."""
    resource = nodegroup.node.default_child
    assert isinstance(resource, eks.CfnNodegroup), type(resource)
    resource.version = version.kubernetes
    if version.ami_release is not None:
        resource.release_version = version.ami_release
