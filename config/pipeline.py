"""The platform config's pipeline section: a self-mutating CDK pipeline, stage by stage."""

from __future__ import annotations


from pydantic import Field, field_validator

from typed_config import FieldProblem, StrictModel
from config.fields import (
    AccountId, Name, RegionName,
)



class PipelineStageConfig(StrictModel):
    """One deployment of the platform: an account/region pair, optionally behind a manual approval."""

    name: Name
    account: AccountId
    region: RegionName
    manual_approval: bool = False


class PipelineConfig(StrictModel):
    """A self-mutating CDK pipeline that tests, synthesizes and deploys the platform stage by stage."""

    repository: str = Field(pattern=r"^[\w.-]+/[\w.-]+$")
    branch: str = "main"
    connection_arn: str = Field(
        pattern=r"^arn:aws[a-z-]*:(codeconnections|codestar-connections):[a-z0-9-]+:\d{12}:connection/[0-9a-f-]{36}$"
    )
    stages: list[PipelineStageConfig] = Field(min_length=1)

    @field_validator("stages")
    @classmethod
    def _unique_names(cls, stages: list[PipelineStageConfig]) -> list[PipelineStageConfig]:
        names: set[str] = set()
        targets: set[tuple[str, str]] = set()
        for i, stage in enumerate(stages):
            if stage.name in names:
                raise FieldProblem(f"[{i}].name", stage.name, "a name not used by another stage", "duplicate")
            if (stage.account, stage.region) in targets:
                raise FieldProblem(f"[{i}].account", stage.account, "an account/region no other stage deploys to",
                                   "the stacks would overwrite each other")
            names.add(stage.name)
            targets.add((stage.account, stage.region))
        return stages


def check_pipeline(pipeline: PipelineConfig, account: str | None, region: str) -> None:
    """The pipeline's stages deploy to this platform's region, from an explicit account (cross-check)."""
    if account is None:
        raise FieldProblem("account", None, "the 12-digit id of the account the pipeline runs in",
                           "a pipeline needs an explicit account")
    for i, stage in enumerate(pipeline.stages):
        if stage.region != region:
            raise FieldProblem(f"pipeline.stages[{i}].region", stage.region, f"{region} (region)",
                               "compute_az and control_plane_az are AZs of region")
