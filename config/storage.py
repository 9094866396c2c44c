"""The platform config's storage sections: FSx for Lustre, its S3 bucket, the image repository."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from typed_config import FieldProblem, StrictModel
from config.fields import (
    RetentionDays,
)


# FSx for Lustre rules (AWS FSx API reference, CreateFileSystem).
FSX_CAPACITY_STEP_GIB = 2400
FSX_SMALL_CAPACITIES_GIB = (1200, 2400)
FSX_MAX_CAPACITY_GIB = 2_400 * 1_000


class FsxDeploymentType(str, Enum):
    PERSISTENT_2 = "PERSISTENT_2"
    SCRATCH_2 = "SCRATCH_2"


class FsxCompression(str, Enum):
    LZ4 = "LZ4"
    NONE = "NONE"


# Throughput per TiB of storage that each deployment type accepts; None = not settable.
FSX_THROUGHPUT_BY_TYPE: dict[FsxDeploymentType, tuple[int, ...] | None] = {
    FsxDeploymentType.PERSISTENT_2: (125, 250, 500, 1000),
    FsxDeploymentType.SCRATCH_2: None,
}


S3Prefix = Annotated[str, Field(pattern=r"^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*/$")]


class FsxConfig(StrictModel):
    """FSx for Lustre, linked to the data bucket."""

    deployment_type: FsxDeploymentType = FsxDeploymentType.PERSISTENT_2
    storage_capacity_gib: int = 1200
    throughput_per_tib: int | None = None  # None: 250 for PERSISTENT_2, unset for SCRATCH_2
    data_prefix: S3Prefix = "datasets/"
    checkpoint_prefix: S3Prefix = "checkpoints/"
    compression: FsxCompression = FsxCompression.LZ4
    automatic_backup_retention_days: int | None = Field(default=None, ge=0, le=90)  # None: 7, or 0 for SCRATCH_2
    log_retention_days: RetentionDays = 90
    retain_on_delete: bool = True

    @model_validator(mode="before")
    @classmethod
    def _defaults_by_type(cls, data: Any) -> Any:
        # Defaults depend on the deployment type, so a user who only switches the type
        # is not told off for values they never wrote.
        if isinstance(data, dict):
            scratch = data.get("deployment_type") == FsxDeploymentType.SCRATCH_2.value
            data = dict(data)
            if data.get("throughput_per_tib") is None and not scratch:
                data["throughput_per_tib"] = 250
            if data.get("automatic_backup_retention_days") is None:
                data["automatic_backup_retention_days"] = 0 if scratch else 7
        return data

    @field_validator("storage_capacity_gib")
    @classmethod
    def _capacity(cls, v: int) -> int:
        if v in FSX_SMALL_CAPACITIES_GIB or (0 < v <= FSX_MAX_CAPACITY_GIB and v % FSX_CAPACITY_STEP_GIB == 0):
            return v
        raise FieldProblem("", v, "1200, 2400 or a multiple of 2400 (4800, 7200, ...)")

    @model_validator(mode="after")
    def _throughput(self):
        allowed = FSX_THROUGHPUT_BY_TYPE[self.deployment_type]
        kind = self.deployment_type.value
        if allowed is None and self.throughput_per_tib is not None:
            raise FieldProblem("throughput_per_tib", self.throughput_per_tib, f"null (omit it) for {kind}")
        if allowed is not None and self.throughput_per_tib not in allowed:
            raise FieldProblem(
                "throughput_per_tib", self.throughput_per_tib, f"{', '.join(map(str, allowed))} for {kind}"
            )
        if self.deployment_type is FsxDeploymentType.SCRATCH_2 and self.automatic_backup_retention_days:
            raise FieldProblem(
                "automatic_backup_retention_days",
                self.automatic_backup_retention_days,
                f"0 for {kind}, which has no backups",
            )
        # Two links may not overlap on either side (FSx rule), so neither prefix may contain the other.
        if self.checkpoint_prefix.startswith(self.data_prefix) or self.data_prefix.startswith(self.checkpoint_prefix):
            raise FieldProblem(
                "checkpoint_prefix",
                self.checkpoint_prefix,
                f"a prefix that neither contains nor lies inside data_prefix ({self.data_prefix})",
            )
        return self

    @property
    def data_path(self) -> str:
        """Where ``data_prefix`` appears on the file system, e.g. ``/datasets``."""
        return file_system_path(self.data_prefix)

    @property
    def checkpoint_path(self) -> str:
        """Where ``checkpoint_prefix`` appears on the file system, e.g. ``/checkpoints``."""
        return file_system_path(self.checkpoint_prefix)


def file_system_path(s3_prefix: str) -> str:
    """The file-system directory an S3 prefix is linked to: ``datasets/`` <-> ``/datasets``."""
    return "/" + s3_prefix.rstrip("/")


class BucketConfig(StrictModel):
    """The S3 bucket behind the file system: datasets and checkpoints, versioned."""

    retain_on_delete: bool = True
    noncurrent_version_retention_days: int = Field(default=30, ge=1, le=3650)
    access_log_retention_days: int = Field(default=365, ge=1, le=3650)


class EcrConfig(StrictModel):
    """The trainer image repository."""

    repository_name: str = Field(default="trainer", pattern=r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$")
    max_image_count: int = Field(default=30, ge=1, le=1000)
    retain_on_delete: bool = True
