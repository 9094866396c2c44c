"""Slurm stack (optional, ``slurm:`` in the config): AWS ParallelCluster with one Slurm queue per listed
accelerated node group, on the network, file system, image repository and catalog the EKS platform uses."""

from __future__ import annotations

from pathlib import PurePosixPath

from aws_cdk import CfnOutput, Stack
from constructs import Construct

from cdk_constructs.slurm_cluster import SlurmCluster, SlurmClusterProps, SlurmQueueProps
from config import PlatformConfig
from config.node_groups import CapacityType
from config.versions import PARALLELCLUSTER_VERSION
from stacks.network_stack import NetworkStack
from stacks.storage_stack import StorageStack
from training.contract import FSX_MOUNT, SLURM_KILL_WAIT_S, cache_dir, checkpoint_dir, staging_dir


class SlurmStack(Stack):
    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, network: NetworkStack,
                 storage: StorageStack, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        slurm = config.slurm
        net = network.network
        groups = {g.name: g for g in config.accelerated_node_groups}
        queues = []
        for queue in slurm.queues:
            group = groups[queue.node_group]
            reservation = group.capacity_reservation
            queues.append(SlurmQueueProps(
                name=group.name, instance=group.instance, max_count=group.max_size, efa=config.slurm_queue_efa(queue),
                placement_group=group.placement_group, spot=group.capacity_type is CapacityType.SPOT,
                capacity_block_id=reservation.id if reservation and reservation.kind == "capacity_block" else None,
                capacity_reservation_id=reservation.id if reservation and reservation.kind == "on_demand" else None))
        file_system_id = slurm.file_system.id if slurm.file_system else storage.file_system.volume.file_system_id
        self.cluster = SlurmCluster(self, "Slurm", SlurmClusterProps(
            cluster_name=config.slurm_cluster_name, parallelcluster_version=PARALLELCLUSTER_VERSION,
            region=config.region, head_node_instance_type=slurm.head_node_instance_type,
            subnet=net.compute_subnet, security_group=net.node_security_group, ssh_cidr=config.network.vpc_cidr,
            file_system_id=file_system_id, queues=queues,
            # The registry's repository, by name, as the Batch stack names it: no cross-stack export to pin.
            repository_arn=self.format_arn(service="ecr", resource="repository",
                                           resource_name=config.ecr.repository_name),
            scaledown_idle_minutes=slurm.scaledown_idle_minutes, kill_wait_s=SLURM_KILL_WAIT_S,
            log_retention_days=slurm.log_retention_days,
            retain_on_delete=slurm.retain_on_delete, mount_dir=FSX_MOUNT,
            # Where jobs keep checkpoints, staged writes and caches: each job makes its own folder inside.
            shared_folders=[str(PurePosixPath(folder("job")).parent) for folder in (checkpoint_dir, staging_dir, cache_dir)]))
        CfnOutput(self, "ClusterName", value=config.slurm_cluster_name,
                  description="The ParallelCluster cluster (pcluster describe-cluster --cluster-name)")
        CfnOutput(self, "HeadNodeInstanceId", value=self.cluster.head_node_instance_id,
                  description="The head node: Slurm commands run there through SSM")
        CfnOutput(self, "Region", value=self.region)
        CfnOutput(self, "ParallelClusterVersion", value=PARALLELCLUSTER_VERSION)
