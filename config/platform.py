"""The typed platform config: one YAML file, validated before anything is synthesized.

Each section is a model of its own module (config/network.py, node_groups.py, cluster.py, storage.py,
jobs.py, pipeline.py, batch.py, slurm.py), with the checks across sections beside it; this module
composes them. Every model forbids unknown keys. Rules that span fields raise :class:`FieldProblem`,
which names the offending field, so each mistake becomes one line: field, bad value, what is allowed
(see :mod:`config.loader`).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator, model_validator

from config.regions import availability_zones
from config.versions import (
    CLUSTER_AUTOSCALER_CHARTS,
)
from typed_config import FieldProblem, StrictModel
from config.fields import (
    Name,
)
from config import batch, cluster, pipeline, slurm
from config.batch import BatchConfig
from config.cluster import ClusterConfig, MonitoringConfig, VersionsConfig
from config.jobs import JobsConfig
from config.network import NetworkConfig
from config.node_groups import AcceleratedNodeGroupConfig, SystemNodeGroupConfig
from config.pipeline import PipelineConfig
from config.slurm import SlurmConfig, SlurmQueueConfig
from config.storage import BucketConfig, EcrConfig, FsxConfig


# The platform's stacks (stacks/platform.py), each named by PlatformConfig.stack_name.
STACKS = ("network", "registry", "storage", "cluster", "batch", "slurm", "pipeline")

# AWS tag rules (Tagging AWS resources, "Tag naming limits and requirements"): 50 tags per
# resource, keys up to 128 and values up to 256 characters of these, no aws: prefix.
TAG_TEXT = re.compile(r"[\w\s+\-=.:/@]*")
PLATFORM_TAGS = ("platform",)
MAX_USER_TAGS = 50 - len(PLATFORM_TAGS)


class PlatformConfig(StrictModel):
    """Everything one platform deployment needs."""

    name_prefix: Name
    account: Annotated[str, Field(pattern=r"^\d{12}$")] | None = None
    region: Annotated[str, Field(pattern=r"^[a-z]{2}(-[a-z]+)+-\d$")]
    compute_az: str
    control_plane_az: str
    network: NetworkConfig = NetworkConfig()
    cluster: ClusterConfig
    system_node_group: SystemNodeGroupConfig = SystemNodeGroupConfig()
    accelerated_node_groups: list[AcceleratedNodeGroupConfig] = Field(min_length=1)
    fsx: FsxConfig = FsxConfig()
    bucket: BucketConfig = BucketConfig()
    ecr: EcrConfig = EcrConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    versions: VersionsConfig = VersionsConfig()
    jobs: JobsConfig = JobsConfig()
    pipeline: PipelineConfig | None = None
    batch: BatchConfig | None = None
    slurm: SlurmConfig | None = None
    tags: dict[Annotated[str, Field(min_length=1, max_length=128)], Annotated[str, Field(max_length=256)]] = {}

    @field_validator("tags")
    @classmethod
    def _taggable(cls, tags: dict[str, str]) -> dict[str, str]:
        if len(tags) > MAX_USER_TAGS:
            raise FieldProblem("", f"{len(tags)} tags", f"at most {MAX_USER_TAGS}",
                               f"AWS allows 50 per resource and the platform adds {', '.join(PLATFORM_TAGS)}")
        for key, value in tags.items():
            if key.lower().startswith("aws:"):
                raise FieldProblem(key, key, "a key that does not start with aws: (AWS reserves that prefix)")
            if key in PLATFORM_TAGS:
                raise FieldProblem(key, key, "another key", "the platform sets this tag itself")
            for text in (key, value):
                if not TAG_TEXT.fullmatch(text):
                    raise FieldProblem(key, text, "letters, digits, spaces and _ . : / = + - @ (AWS tag rules)")
        return tags

    @field_validator("compute_az", "control_plane_az")
    @classmethod
    def _az_in_region(cls, v: str, info: ValidationInfo) -> str:
        region = info.data.get("region")
        if region is None:  # the region itself is invalid and already reported
            return v
        if not re.fullmatch(rf"{re.escape(region)}[a-z]", v):
            raise FieldProblem("", v, f"an Availability Zone of {region}, e.g. {region}a", f"not in region {region}")
        zones = availability_zones(region)
        if zones is not None and v not in zones:
            raise FieldProblem("", v, ", ".join(zones), f"{region} has no such Availability Zone")
        if info.field_name == "control_plane_az" and v == info.data.get("compute_az"):
            raise FieldProblem("", v, "a second AZ, different from compute_az (EKS needs two)")
        return v

    @field_validator("accelerated_node_groups")
    @classmethod
    def _unique_names(cls, groups: list[AcceleratedNodeGroupConfig]) -> list[AcceleratedNodeGroupConfig]:
        seen: set[str] = set()
        for i, group in enumerate(groups):
            if group.name in seen:
                raise FieldProblem(f"[{i}].name", group.name, "a name not used by another node group", "duplicate")
            seen.add(group.name)
        return groups

    # The cross-checks between sections, each beside its own section (config/<section>.py), in this order.
    @model_validator(mode="after")
    def _versions_fit_the_cluster(self):
        cluster.check_versions(self.cluster, self.versions, self.accelerated_node_groups)
        return self

    @model_validator(mode="after")
    def _node_check_images(self):
        cluster.check_node_check(self.cluster.node_check, self.accelerated_node_groups)
        return self

    @property
    def cluster_autoscaler_chart(self) -> str:
        return self.versions.cluster_autoscaler_chart or CLUSTER_AUTOSCALER_CHARTS[self.cluster.kubernetes_version]

    def stack_name(self, stack: str) -> str:
        """A stack's CloudFormation name, ``<name_prefix>-<stack>``: the name the README, trainctl and the
        charts use, in the App and in a pipeline stage alike."""
        if stack not in STACKS:
            raise ValueError(f"stack: got {stack!r}; allowed: {', '.join(STACKS)}")
        return f"{self.name_prefix}-{stack}"

    def batch_name(self, group: str) -> str:
        """A Batch node group's compute environment, job queue and job definition name."""
        return f"{self.name_prefix}-{group}"

    @property
    def batch_log_group(self) -> str:
        """Where Batch jobs' container logs go (awslogs)."""
        return f"/aws/batch/{self.name_prefix}-training"

    @model_validator(mode="after")
    def _batch_fits(self):
        if self.batch is not None:
            batch.check_batch(self.batch, self.accelerated_node_groups)
        return self

    @property
    def slurm_cluster_name(self) -> str:
        """The ParallelCluster cluster (and the stack ParallelCluster creates for it): never the slurm
        stack's own name, <prefix>-slurm ("Cluster resource", ParallelCluster User Guide)."""
        return f"{self.name_prefix}-slurm-cluster"

    @model_validator(mode="after")
    def _slurm_fits(self):
        if self.slurm is not None:
            slurm.check_slurm(self.slurm, self.accelerated_node_groups, self.compute_az)
        return self

    def slurm_queue_efa(self, queue: SlurmQueueConfig) -> bool:
        """EFA on a queue's compute resource: its own setting, else its node group's."""
        group = next(g for g in self.accelerated_node_groups if g.name == queue.node_group)
        return group.efa_enabled if queue.efa is None else queue.efa

    @model_validator(mode="after")
    def _pipeline_fits(self):
        if self.pipeline is not None:
            pipeline.check_pipeline(self.pipeline, self.account, self.region)
        return self
