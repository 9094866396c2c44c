"""Registry stack: the trainer image repository and the worker-node role that pulls from it."""

from __future__ import annotations

from aws_cdk import CfnOutput, Stack
from constructs import Construct

from cdk_constructs.image_repository import ImageRepositoryProps, TrainerImageRepository
from cdk_constructs.nag import acknowledge
from cdk_constructs.node_role import WorkerNodeRole
from config import PlatformConfig
from stacks.removal import removal


class RegistryStack(Stack):
    """Outlives the cluster: it is deleted after the cluster stack, so nodes never lose
    their role or their images while they run. Typed attributes: ``repository``, ``node_role``.
    """

    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        self.repository = TrainerImageRepository(
            self,
            "Images",
            ImageRepositoryProps(
                repository_name=config.ecr.repository_name,
                max_image_count=config.ecr.max_image_count,
                removal_policy=removal(config.ecr.retain_on_delete),
            ),
        ).repository

        self.node_role = WorkerNodeRole(self, "Nodes").role
        self.repository.grant_pull(self.node_role)
        acknowledge(
            self.node_role,
            "IAM5",
            "grant_pull: ecr:GetAuthorizationToken has no resource-level permissions; every other ECR "
            "action is scoped to the trainer repository.",
            finding="Resource::*",
        )

        CfnOutput(self, "ImageRepositoryUri", value=self.repository.repository_uri,
                  description="ECR repository for trainer images (tags gpu-<version>, neuron-<version>)")
        CfnOutput(self, "NodeRoleArn", value=self.node_role.role_arn, description="IAM role of every worker node")
