"""A self-mutating CDK pipeline: test, synthesize, then deploy the platform stage by stage.

Deploy it once from a workstation (``npx cdk deploy <prefix>-pipeline``); from then on
every push to the branch runs the README's test command, synthesizes, updates the pipeline
itself, and deploys each configured stage in order. A failing test stops everything.
"""

from __future__ import annotations

import json
from pathlib import Path

from aws_cdk import App, Duration, Environment, Stack, Stage, Tags, aws_codebuild as codebuild, pipelines
from constructs import Construct

from cdk_constructs.nag import acknowledge
from config import PlatformConfig
from config.pipeline import PipelineStageConfig
from stacks.platform import Platform, add_platform_stacks, add_policy_checks, build_platform

# The README's second command, then its first: nothing is synthesized from untested code.
TEST_COMMAND = "make test"
SYNTH_COMMAND = "make synth CONFIG={config}"
# Manifests ride along in the cloud assembly, which the pipeline keeps as an artifact.
KEEP_MANIFESTS = "cp -r dist cdk.out/manifests"
PACKAGE_JSON = Path(__file__).resolve().parent.parent / "package.json"


def pinned_node_tool(name: str) -> str:
    """The version package.json pins for ``name`` (the CDK CLI, cdk-assets): one source for every step."""
    return json.loads(PACKAGE_JSON.read_text())["devDependencies"][name]


class PlatformStage(Stage):
    """The platform's stacks in one account/region."""

    def __init__(self, scope: Construct, config: PlatformConfig, stage: PipelineStageConfig) -> None:
        super().__init__(scope, stage.name, env=Environment(account=stage.account, region=stage.region))
        self.platform: Platform = add_platform_stacks(self, config, env=None)


class PipelineStack(Stack):
    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, config_path: str, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        settings = config.pipeline
        source = pipelines.CodePipelineSource.connection(
            settings.repository, settings.branch, connection_arn=settings.connection_arn)
        self.synth_step = pipelines.ShellStep(
            "Synth",
            input=source,
            env={
                "CI": "true",
                "CDK_DISABLE_CLI_TELEMETRY": "true",
                # The tests need torch on CPU only; PyPI's default Linux wheel pulls GBs of CUDA.
                "PIP_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cpu",
            },
            commands=[TEST_COMMAND, SYNTH_COMMAND.format(config=config_path), KEEP_MANIFESTS],
            primary_output_directory="cdk.out",
        )
        self.pipeline = pipelines.CodePipeline(
            self, "Pipeline",
            pipeline_name=f"{config.name_prefix}-platform",
            synth=self.synth_step,
            self_mutation=True,
            # Self-mutation and asset publishing install these with npm; unpinned they take @latest,
            # and a CLI 3.x cannot read what aws-cdk-lib 2.27x writes.
            cli_version=pinned_node_tool("aws-cdk"),
            cdk_assets_cli_version=pinned_node_tool("cdk-assets"),
            # KMS-encrypted artifacts, readable by the stage accounts' bootstrap roles only.
            cross_account_keys=True,
            enable_key_rotation=True,
            # The test suite runs real etcd and torchrun agents: give it cores and time.
            synth_code_build_defaults=pipelines.CodeBuildOptions(
                build_environment=codebuild.BuildEnvironment(
                    build_image=codebuild.LinuxBuildImage.STANDARD_7_0,
                    compute_type=codebuild.ComputeType.LARGE,
                ),
                timeout=Duration.minutes(90),
            ),
        )
        self.stages: list[PlatformStage] = []
        for stage_config in settings.stages:
            stage = PlatformStage(self, config, stage_config)
            pre = [pipelines.ManualApprovalStep(f"Approve-{stage_config.name}")] if stage_config.manual_approval else []
            self.pipeline.add_stage(stage, pre=pre)
            self.stages.append(stage)
        self.pipeline.build_pipeline()
        self._acknowledge_pipeline_findings()

    def _acknowledge_pipeline_findings(self) -> None:
        """CDK Pipelines' generated roles. Each wildcard is listed with what it is scoped to."""
        bucket = f"<{self.get_logical_id(self.pipeline.pipeline.artifact_bucket.node.default_child)}.Arn>/*"
        grants = {
            "CDK's read/write grant on the pipeline's own artifact bucket (objects of that bucket only)": [
                "Action::s3:GetObject*", "Action::s3:GetBucket*", "Action::s3:List*", "Action::s3:DeleteObject*",
                "Action::s3:Abort*", f"Resource::{bucket}"],
            "CDK's encrypt/decrypt grant on the pipeline's own artifact key": [
                "Action::kms:GenerateDataKey*", "Action::kms:ReEncrypt*"],
            "CodeBuild writes its own build logs and test reports; the names carry the project's id": [
                *self._codebuild_log_findings(),
                f"Resource::arn:aws:logs:{self.region}:{self.account}:log-group:/aws/codebuild/*",
                f"Resource::arn:aws:codebuild:{self.region}:{self.account}:report-group/*"],
            "Self-mutation assumes only roles tagged as CDK bootstrap roles (a condition on "
            "iam:ResourceTag/aws-cdk:bootstrap-role); this is the CDK bootstrap trust": [
                f"Resource::arn:*:iam::{self.account}:role/*"],
            "cloudformation:DescribeStacks, s3:ListBucket and the CodeBuild start/stop actions of asset "
            "publishing have no resource-level scoping that CDK Pipelines can use": ["Resource::*"],
        }
        for reason, findings in grants.items():
            for finding in findings:
                acknowledge(self.pipeline, "IAM5", reason, finding)
        acknowledge(self.pipeline.pipeline.artifact_bucket, "S1",
                    "The artifact bucket holds only the pipeline's own intermediates (source snapshot, cloud "
                    "assembly), is KMS-encrypted and TLS-only; CloudTrail data events audit it if required.")

    def _codebuild_log_findings(self) -> list[str]:
        findings = []
        for project in (self.pipeline.synth_project, self.pipeline.self_mutation_project):
            logical_id = self.get_logical_id(project.node.default_child)
            findings += [
                f"Resource::arn:aws:logs:{self.region}:{self.account}:log-group:/aws/codebuild/<{logical_id}>:*",
                f"Resource::arn:aws:codebuild:{self.region}:{self.account}:report-group/<{logical_id}>-*",
            ]
        return findings


def build_app(app: App, config: PlatformConfig, config_path: str) -> Platform | PipelineStack:
    """The platform's stacks, or, with ``pipeline`` configured, the pipeline that deploys them per stage."""
    if config.pipeline is None:
        return build_platform(app, config)
    pipeline = PipelineStack(
        app, config.stack_name("pipeline"), config=config, config_path=config_path,
        env=Environment(account=config.account, region=config.region),
        description=f"{config.name_prefix}: CDK pipeline that tests and deploys the platform",
    )
    Tags.of(app).add("platform", config.name_prefix)
    add_policy_checks(app)
    return pipeline
