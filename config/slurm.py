"""The platform config's slurm section: AWS ParallelCluster with Slurm beside EKS."""

from __future__ import annotations


from pydantic import Field, field_validator

from config.catalog import CATALOG, cpu_types
from typed_config import FieldProblem, StrictModel
from config.node_groups import AcceleratedNodeGroupConfig
from config.fields import (
    Name,
)



# CloudWatch Logs retentions ParallelCluster accepts for Monitoring/Logs/CloudWatch/RetentionInDays
# (aws-parallelcluster 3.16.1, pcluster/schemas/cluster_schema.py CloudWatchLogsSchema): fewer than
# CloudWatch itself (no 1096, 2192, ...), so a value outside is refused here rather than at synth.
PCLUSTER_LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1827, 3653)


class SlurmQueueConfig(StrictModel):
    """One Slurm queue: an accelerated node group's instances, in the compute subnet."""

    # The queue, and its one compute resource, take the node group's name (a Slurm partition name).
    node_group: Name
    # None: the node group's efa_enabled. true only where the catalog lists EFA interfaces.
    efa: bool | None = None
    # None: the compute AZ. Written out only to say it; any other AZ is refused (one compute subnet).
    availability_zone: str | None = None


class SlurmFileSystemConfig(StrictModel):
    """An existing FSx for Lustre file system to mount at /fsx instead of the storage stack's."""

    id: str = Field(pattern=r"^fs-[0-9a-f]{8,17}$")
    availability_zone: str  # its subnet's AZ: it must be compute_az


class SlurmConfig(StrictModel):
    """AWS ParallelCluster with Slurm beside EKS: one queue per listed node group, the same network,
    file system and trainer image (docs/slurm.md)."""

    queues: list[SlurmQueueConfig] = Field(min_length=1)
    head_node_instance_type: str = "m5.2xlarge"
    # None: the storage stack's file system.
    file_system: SlurmFileSystemConfig | None = None
    # An idle compute node is terminated after this many minutes (Slurm's ScaledownIdletime).
    scaledown_idle_minutes: int = Field(default=10, ge=1, le=1440)
    # The cluster's CloudWatch log group keeps events this long, and outlives the cluster.
    log_retention_days: int = 30
    # ParallelCluster's DeletionPolicy: false deletes the cluster with the stack; true keeps it running.
    retain_on_delete: bool = False

    @field_validator("head_node_instance_type")
    @classmethod
    def _cpu_head_node(cls, v: str) -> str:
        if v not in CATALOG or CATALOG[v].is_accelerated:
            raise FieldProblem("", v, ", ".join(cpu_types()), "not a CPU instance type in the catalog")
        return v

    @field_validator("log_retention_days")
    @classmethod
    def _pcluster_retention(cls, v: int) -> int:
        if v not in PCLUSTER_LOG_RETENTION_DAYS:
            raise FieldProblem("", v, ", ".join(map(str, PCLUSTER_LOG_RETENTION_DAYS)),
                               "not a retention ParallelCluster accepts")
        return v


def check_slurm(slurm: SlurmConfig, node_groups: list[AcceleratedNodeGroupConfig], compute_az: str) -> None:
    """Each queue is an NVIDIA node group of the platform's, once, in the compute AZ, with EFA only where
    the instance has it (cross-check)."""
    groups = {g.name: g for g in node_groups}
    storage = slurm.file_system
    if storage is not None and storage.availability_zone != compute_az:
        raise FieldProblem("slurm.file_system.availability_zone", storage.availability_zone,
                           f"{compute_az} (compute_az)", "the compute nodes live in the compute subnet only")
    seen: set[str] = set()
    for i, queue in enumerate(slurm.queues):
        where = f"slurm.queues[{i}]"
        if queue.node_group not in groups:
            raise FieldProblem(f"{where}.node_group", queue.node_group, ", ".join(groups),
                               "not an accelerated node group of this platform")
        if queue.node_group in seen:
            raise FieldProblem(f"{where}.node_group", queue.node_group, "each node group once", "listed twice")
        seen.add(queue.node_group)
        instance = groups[queue.node_group].instance
        if instance.accelerator.value == "neuron":
            raise FieldProblem(f"{where}.node_group", queue.node_group, "a node group of NVIDIA GPUs",
                               f"{instance.name}: ParallelCluster's official AMIs carry no Neuron driver")
        if queue.efa and not instance.supports_efa:
            with_efa = ", ".join(n for n, t in sorted(CATALOG.items())
                                 if t.supports_efa and t.family.startswith(instance.family))
            raise FieldProblem(f"{where}.efa", True, "false for " + instance.name
                               + (f" (EFA: {with_efa})" if with_efa else ""),
                               f"{instance.name} has no EFA interfaces")
        if queue.availability_zone is not None and queue.availability_zone != compute_az:
            raise FieldProblem(f"{where}.availability_zone", queue.availability_zone,
                               f"{compute_az} (compute_az), or leave it out",
                               "every queue runs in the one compute subnet, beside the file system")
