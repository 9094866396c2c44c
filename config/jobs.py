"""The platform config's jobs section: where and how training jobs run in the cluster."""

from __future__ import annotations


from pydantic import Field, field_validator

from typed_config import FieldProblem, StrictModel
from config.fields import (
    IMAGE_HELP, K8sName, pinned_image,
)


class QueueConfig(StrictModel):
    """The Volcano queue training jobs are submitted to."""

    name: K8sName = "training"
    weight: int = Field(default=1, ge=1, le=65535)
    # Jobs of this queue may be preempted when another queue reclaims its share.
    reclaimable: bool = False


class PriorityClassConfig(StrictModel):
    """The PriorityClass training pods run with."""

    name: K8sName = "training"
    value: int = Field(default=1000, ge=0, le=1_000_000_000)


class EtcdConfig(StrictModel):
    """The rendezvous store of the platform-etcd backend (training/launcher/rendezvous.py, etcd's v3 API)."""

    # Each of the three members keeps its Raft log on a gp3 volume of this size (its identity:
    # a member must not come back empty under its old name). Rendezvous state is a few KiB.
    persistent_volume_gib: int = Field(default=2, ge=1, le=100)
    storage_class: K8sName = "gp3"


class JobsConfig(StrictModel):
    """Where and how training jobs run in the cluster."""

    namespace: K8sName = "training"
    platform_namespace: K8sName = "training-platform"
    queue: QueueConfig = QueueConfig()
    priority_class: PriorityClassConfig = PriorityClassConfig()
    etcd: EtcdConfig = EtcdConfig()
    # Finished Volcano jobs and their pods are deleted after this many seconds.
    ttl_seconds_after_finished: int = Field(default=86_400, ge=0)
    # The platform's launcher for jobs that run a program of their own in their own image
    # (docs/job-spec.md, "Your own torchrun program"): an image with training/launcher under /app, e.g. the
    # trainer image or the small one of training/docker/Dockerfile.launcher. None: such jobs are refused.
    launcher_image: str | None = None

    @field_validator("launcher_image")
    @classmethod
    def _pinned(cls, v: str | None) -> str | None:
        if v is not None and not pinned_image(v):
            raise FieldProblem("", v, IMAGE_HELP)
        return v
