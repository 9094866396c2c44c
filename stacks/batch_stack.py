"""Batch stack (optional, ``batch:`` in the config): AWS Batch multi-node parallel training on the
network, file system, image repository and catalog the EKS platform uses."""

from __future__ import annotations

from aws_cdk import CfnOutput, Stack, aws_ec2 as ec2
from constructs import Construct

from cdk_constructs.batch_training import BatchTraining, BatchTrainingProps, batch_log_group
from cdk_constructs.network import RETENTION_BY_DAYS
from config import PlatformConfig
from config.node_groups import CapacityType
from stacks.network_stack import NetworkStack
from stacks.registry_stack import RegistryStack
from stacks.storage_stack import StorageStack


class BatchStack(Stack):
    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, network: NetworkStack,
                 registry: RegistryStack, storage: StorageStack, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        net = network.network
        # Batch instances have no EKS cluster security group to give them egress (ECS, ECR, S3).
        egress = ec2.SecurityGroup(self, "InstanceEgress", vpc=net.vpc, allow_all_outbound=True,
                                   description="Batch training instances: outbound to ECS, ECR and S3")
        logs_group = batch_log_group(self, config.batch_log_group, RETENTION_BY_DAYS[config.monitoring.log_retention_days])
        groups = {g.name: g for g in config.accelerated_node_groups}
        self.training = {}
        for name in config.batch.node_groups:
            queue_name = config.batch_name(name)
            group = groups[name]
            training = BatchTraining(self, f"Group-{name}", BatchTrainingProps(
                name=queue_name, instance=group.instance, max_nodes=group.max_size, efa=group.efa_enabled,
                spot=group.capacity_type is CapacityType.SPOT, instance_tags={"platform-batch-group": name},
                subnet=net.compute_subnet,
                security_groups=[net.node_security_group, egress], file_system=storage.file_system.volume,
                # The registry's repository, by name: a weak reference would be a Fn::GetStackOutput
                # inside Fn::Split, which cfn-lint cannot type.
                repository_uri=f"{self.account}.dkr.ecr.{self.region}.{self.url_suffix}/{config.ecr.repository_name}",
                log_group=logs_group,
                attempts=config.batch.attempts))
            self.training[name] = training
            CfnOutput(self, f"JobQueue{name.replace('-', '')}", value=training.queue.ref,
                      description=f"Batch job queue of node group {name}")
        CfnOutput(self, "JobLogGroup", value=logs_group.log_group_name)
