"""The platform config's batch section: AWS Batch multi-node parallel jobs."""

from __future__ import annotations


from pydantic import Field

from typed_config import FieldProblem, StrictModel
from config.node_groups import AcceleratedNodeGroupConfig
from config.fields import (
    Name,
)



# Instance families an AWS Batch compute environment here can run: Batch's GPU AMI for ECS
# (ECS_AL2023_NVIDIA, the default for GPU families since January 2026) does not support p3, and
# Batch offers no AMI type with the Neuron driver (botocore's batch model, Ec2Configuration.imageType).
BATCH_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "g5", "g6e")


class BatchConfig(StrictModel):
    """AWS Batch multi-node parallel jobs on the same network, storage and image as EKS.

    Each listed accelerated node group also becomes a Batch compute environment (its instance
    type, EFA, placement group and max_size, at 0 vCPUs when idle) with a job queue and a job
    definition of the same name.
    """

    node_groups: list[Name] = Field(min_length=1)
    # Attempts of a job: a lost host or a Spot reclaim is retried, a config or code error is not.
    attempts: int = Field(default=3, ge=1, le=10)


def check_batch(batch: BatchConfig, node_groups: list[AcceleratedNodeGroupConfig]) -> None:
    """Each Batch node group is one of the platform's, of a family Batch runs here, listed once (cross-check)."""
    groups = {g.name: g for g in node_groups}
    for i, name in enumerate(batch.node_groups):
        where = f"batch.node_groups[{i}]"
        if name not in groups:
            raise FieldProblem(where, name, ", ".join(groups), "not an accelerated node group of this platform")
        instance = groups[name].instance
        if instance.family not in BATCH_FAMILIES:
            why = ("Batch offers no AMI with the Neuron driver" if instance.accelerator.value == "neuron" else
                   "Batch's GPU AMI for ECS (ECS_AL2023_NVIDIA) does not support it")
            raise FieldProblem(where, name, "a node group of a family Batch runs here: " + ", ".join(BATCH_FAMILIES),
                               f"{instance.name}: {why}")
        if batch.node_groups.index(name) != i:
            raise FieldProblem(where, name, "each node group once", "listed twice")
