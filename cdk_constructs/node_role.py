"""The IAM role every worker node runs as."""

from __future__ import annotations

from aws_cdk import aws_iam as iam
from constructs import Construct

from cdk_constructs.nag import acknowledge

NODE_MANAGED_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryPullOnly")


class WorkerNodeRole(Construct):
    """EC2 role for EKS worker nodes: join the cluster and pull images, nothing else.

    Pods get their own AWS permissions through Pod Identity (the VPC CNI, the FSx CSI
    driver, the CloudWatch agent), so none of those policies sit on the node.
    """

    def __init__(self, scope: Construct, id: str) -> None:
        super().__init__(scope, id)
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description="EKS worker nodes (system and accelerated)",
            managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(n) for n in NODE_MANAGED_POLICIES],
        )
        reasons = {
            "AmazonEKSWorkerNodePolicy": "EKS requires it on every node role, to join the cluster.",
            "AmazonEC2ContainerRegistryPullOnly": "Add-on images (VPC CNI, CoreDNS, kube-proxy) live in "
            "AWS-owned registries whose accounts differ by region; this policy is their read-only pull.",
        }
        for name in NODE_MANAGED_POLICIES:
            acknowledge(self.role, "IAM4", reasons[name], finding=f"Policy::arn:<AWS::Partition>:iam::aws:policy/{name}")
