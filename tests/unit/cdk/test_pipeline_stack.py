"""The optional CDK pipeline: tests before synth, stages in order behind approvals, the same platform."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from aws_cdk import App, Validations
from syrupy.extensions.json import JSONSnapshotExtension

from config import ConfigError, parse_config
from stacks import build_app, build_platform
from stacks.app_factory import cli_context
from tests.conftest import TEST_ACCOUNT, config_variant, mask_asset_hashes

PROD_ACCOUNT = "210987654321"
CONNECTION = "arn:aws:codeconnections:us-west-2:123456789012:connection/0a1b2c3d-1111-2222-3333-444455556666"
# The AZ lookup of the second account, as `cdk synth` with its credentials would cache it.
PROD_CONTEXT = {f"availability-zones:account={PROD_ACCOUNT}:region=us-west-2": ["us-west-2a", "us-west-2b", "us-west-2c"]}


def pipeline_data(**stage_changes):
    data = config_variant(account=TEST_ACCOUNT)
    data["pipeline"] = {
        "repository": "my-org/training-platform",
        "branch": "main",
        "connection_arn": CONNECTION,
        "stages": [
            {"name": "dev", "account": TEST_ACCOUNT, "region": "us-west-2"},
            {"name": "prod", "account": PROD_ACCOUNT, "region": "us-west-2", "manual_approval": True},
        ],
    }
    return data


def synth_pipeline(outdir: Path):
    """The example config with a two-stage pipeline, synthesized into ``outdir``."""
    app = App(context=cli_context(PROD_CONTEXT), outdir=str(outdir))
    stack = build_app(app, parse_config(pipeline_data()), "config/example.yaml")
    assembly = app.synth()  # cdk-nag runs here: an unacknowledged finding raises
    template = json.loads((outdir / stack.template_file).read_text())
    return stack, assembly, template, outdir


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return synth_pipeline(tmp_path_factory.mktemp("pipeline.out"))


def resources(template, kind):
    return [r["Properties"] for r in template["Resources"].values() if r["Type"] == kind]


def test_pipeline_snapshot(pipeline, snapshot):
    _, _, template, _ = pipeline
    assert mask_asset_hashes(template) == snapshot.use_extension(JSONSnapshotExtension)


def test_the_synth_step_runs_the_tests_before_synth_and_keeps_the_manifests(pipeline):
    _, _, template, _ = pipeline
    specs = [json.loads(p["Source"]["BuildSpec"]) for p in resources(template, "AWS::CodeBuild::Project")
             if "make test" in p["Source"].get("BuildSpec", "")]
    assert len(specs) == 1
    commands = specs[0]["phases"]["build"]["commands"]
    assert commands == ["make test", "make synth CONFIG=config/example.yaml", "cp -r dist cdk.out/manifests"]
    assert specs[0]["artifacts"]["base-directory"] == "cdk.out"
    project = next(p for p in resources(template, "AWS::CodeBuild::Project") if "make test" in p["Source"]["BuildSpec"])
    env = {v["Name"]: v["Value"] for v in project["Environment"]["EnvironmentVariables"]}
    assert env["CI"] == "true" and env["PIP_EXTRA_INDEX_URL"].endswith("/whl/cpu")


def stages(template):
    return resources(template, "AWS::CodePipeline::Pipeline")[0]["Stages"]


def test_stages_follow_the_config_with_approval_before_prod(pipeline):
    _, _, template, _ = pipeline
    names = [s["Name"] for s in stages(template)]
    assert names[:3] == ["Source", "Build", "UpdatePipeline"] and names[-2:] == ["dev", "prod"]
    by_name = {s["Name"]: s for s in stages(template)}

    def first(stage):
        return min(by_name[stage]["Actions"], key=lambda a: a["RunOrder"])

    assert first("prod")["ActionTypeId"]["Category"] == "Approval"
    assert all(a["ActionTypeId"]["Category"] != "Approval" for a in by_name["dev"]["Actions"])


def test_self_mutation_and_asset_publishing_install_the_repos_pinned_cli_and_cdk_assets(pipeline):
    _, _, template, _ = pipeline
    package = json.loads((Path(__file__).resolve().parents[3] / "package.json").read_text())["devDependencies"]
    installs = {c for p in resources(template, "AWS::CodeBuild::Project")
                for phase in json.loads(p["Source"]["BuildSpec"])["phases"].values()
                for c in phase.get("commands", []) if c.startswith("npm install")}
    assert installs == {f"npm install -g aws-cdk@{package['aws-cdk']}", f"npm install -g cdk-assets@{package['cdk-assets']}"}


def test_the_first_stage_proves_a_job_runs_before_the_approval_of_the_next(pipeline):
    _, _, template, outdir = pipeline
    # Each stage's cluster stack ends by waiting for a job through Volcano (CfnOutput PlatformCheck);
    # its deploy fails otherwise, and the prod approval comes only after dev's deploy.
    dev_cluster = json.loads(next(outdir.glob("assembly-*-dev/*mltraincluster*.template.json")).read_text())
    waits = [r for r in dev_cluster["Resources"].values() if r["Type"] == "Custom::AWSCDK-EKS-KubernetesObjectValue"
             and r["Properties"]["ObjectType"] == "jobs.batch.volcano.sh"]
    assert len(waits) == 1 and "Completed" in waits[0]["Properties"]["JsonPath"]
    assert "PlatformCheck" in dev_cluster["Outputs"]
    names = [s["Name"] for s in stages(template)]
    assert names.index("dev") < names.index("prod")


def test_stages_deploy_through_each_accounts_bootstrap_roles(pipeline):
    _, _, template, _ = pipeline
    prod = next(s for s in stages(template) if s["Name"] == "prod")
    deploy_roles = {json.dumps(a.get("RoleArn")) for a in prod["Actions"] if a["ActionTypeId"]["Category"] == "Deploy"}
    assert deploy_roles and all(PROD_ACCOUNT in r and "deploy-role" in r for r in deploy_roles)


def test_artifacts_are_encrypted_with_a_rotated_key_and_the_source_needs_no_credentials(pipeline):
    _, _, template, _ = pipeline
    store = resources(template, "AWS::CodePipeline::Pipeline")[0]["ArtifactStore"]
    assert store["EncryptionKey"]["Type"] == "KMS"
    assert all(k.get("EnableKeyRotation") for k in resources(template, "AWS::KMS::Key"))
    source = stages(template)[0]["Actions"][0]
    assert source["ActionTypeId"]["Provider"] == "CodeStarSourceConnection"
    assert source["Configuration"]["ConnectionArn"] == CONNECTION
    assert "OAuthToken" not in json.dumps(template)


def comparable(template: dict, stage_path: str = "") -> dict:
    """A template with what only names the construct tree taken out.

    Inside a stage, construct paths start with ``<pipeline>/<stage>/``: that shows in the
    ``aws:cdk:path`` metadata, in the VPC's Name tags, and in the logical ids of security
    group rules (named after the peer's path). Those rules are keyed by their content instead.
    Asset paths are relative to each assembly's folder, and the kubectl provider's prune labels
    hash the construct path.
    """
    text = json.dumps(template)
    if stage_path:
        text = text.replace(f"{stage_path}/", "")
    # The kubectl provider labels manifests for pruning with a hash of the chart's construct path.
    text = re.sub(r"aws\.cdk\.eks/prune-[0-9a-f]{42}", "aws.cdk.eks/prune-<path-hash>", text)
    out = mask_asset_hashes(json.loads(text))
    keyed = {}
    for logical_id, resource in out.get("Resources", {}).items():
        resource.get("Metadata", {}).pop("aws:cdk:path", None)
        resource.get("Metadata", {}).pop("aws:asset:path", None)  # relative to each assembly's folder
        if resource["Type"] in ("AWS::EC2::SecurityGroupIngress", "AWS::EC2::SecurityGroupEgress"):
            logical_id = f"{resource['Type']}:{json.dumps(resource['Properties'], sort_keys=True)}"
        keyed[logical_id] = resource
    out["Resources"] = keyed
    return out


def test_a_stage_deploys_the_same_platform_as_a_direct_synth(pipeline, tmp_path):
    _, _, _, outdir = pipeline
    app = App(context=cli_context(), outdir=str(tmp_path))
    build_platform(app, parse_config(config_variant(account=TEST_ACCOUNT)))
    direct = app.synth()
    for stack in direct.stacks:
        staged = next(Path(outdir).glob(f"assembly-*-dev/*{stack.stack_name.replace('-', '')}*.template.json"))
        assert comparable(json.loads(staged.read_text()), "mltrain-pipeline/dev") == comparable(stack.template), (
            stack.stack_name)


def test_stage_stacks_keep_the_platform_stack_names(pipeline):
    stack, _, _, _ = pipeline
    assert [s.stack_name for s in stack.stages[1].platform.stacks] == [
        "mltrain-network", "mltrain-registry", "mltrain-storage", "mltrain-cluster"]


@pytest.mark.parametrize(("change", "expected"), [
    (lambda d: d.pop("account"), "account: got null (a pipeline needs an explicit account); allowed: the 12-digit"),
    (lambda d: d["pipeline"]["stages"][1].update(region="eu-west-1"),
     'pipeline.stages[1].region: got "eu-west-1" (compute_az and control_plane_az are AZs of region); allowed: '
     "us-west-2 (region)"),
    (lambda d: d["pipeline"]["stages"][1].update(account=TEST_ACCOUNT),
     'pipeline.stages[1].account: got "123456789012" (the stacks would overwrite each other)'),
    (lambda d: d["pipeline"].update(connection_arn="arn:aws:iam::123456789012:role/x"),
     'pipeline.connection_arn: got "arn:aws:iam::123456789012:role/x"; allowed: a CodeConnections connection ARN'),
])
def test_pipeline_config_mistakes_are_one_line(change, expected):
    data = pipeline_data()
    change(data)
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert len(caught.value.problems) == 1 and caught.value.problems[0].startswith(expected), caught.value.problems


def test_the_pipeline_acknowledges_only_its_generated_roles_and_artifact_bucket(pipeline):
    stack, _, _, _ = pipeline
    found = {}
    for construct in stack.node.find_all():
        for entry in construct.node.metadata:
            if entry.type == Validations.ACKNOWLEDGED_RULES_METADATA_KEY:
                for rule, reason in entry.data.items():
                    found[(construct.node.path, rule)] = reason
    stage_paths = {key for key in found if "/dev/" in key[0] or "/prod/" in key[0]}
    pipeline_acks = {key for key in found if key not in stage_paths}
    assert {path for path, _ in pipeline_acks} == {"mltrain-pipeline/Pipeline",
                                                  "mltrain-pipeline/Pipeline/Pipeline/ArtifactsBucket"}
    assert {rule.split("[")[0] for _, rule in pipeline_acks} == {"AwsSolutions::AwsSolutions-IAM5",
                                                                 "AwsSolutions::AwsSolutions-S1"}
    assert all(len(found[key]) > 40 for key in pipeline_acks)
