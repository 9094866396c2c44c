"""Every synthesized template: snapshot (asset hashes masked), cfn-lint, cdk-nag."""

from __future__ import annotations

import json

import pytest
from cfnlint.api import ManualArgs, lint_file
from syrupy.extensions.json import JSONSnapshotExtension

from tests.conftest import VARIANTS, mask_asset_hashes

# cfn-lint findings accepted, each with its scope (a logical-id prefix, or None for every
# resource) and the reason.
ACCEPTED_CFN_LINT = [
    (
        "W3010",
        None,
        "AZs are hard-coded on purpose: FSx for Lustre and every accelerated node group must share "
        "the one compute AZ the config names (docs/DESIGN.md, 'Single compute AZ').",
    ),
    (
        "W3005",
        "CustomVpcRestrictDefaultSGCustomResourceProvider",
        "aws-cdk-lib's own provider for restricting the default security group declares a DependsOn "
        "its Role reference already implies; harmless, and not our code to change.",
    ),
    (
        "W3005",
        "ClusterKubectlProvider",
        "aws-cdk-lib's kubectl provider Lambdas declare a DependsOn on their roles that the Role reference implies.",
    ),
    (
        "W3005",
        "AWS679f53fac002430cb0da5b7982bd2287",
        "aws-cdk-lib's AwsCustomResource Lambda declares a DependsOn on its role that the Role reference implies.",
    ),
    (
        "W3005",
        "NodegroupDesiredSize4f1e7a52",
        "aws-cdk-lib's SingletonFunction (the node groups' desired-size handler) declares a DependsOn on its role "
        "that the Role reference implies.",
    ),
    (
        "W3005",
        "Pipeline9850B417",
        "aws-cdk-lib's CodePipeline declares a DependsOn on its role that the RoleArn reference already implies.",
    ),
]


def _accepted(match) -> bool:
    logical_id = match.path[1] if len(match.path) > 1 and match.path[0] == "Resources" else ""
    return any(
        match.rule.id == rule and (scope is None or str(logical_id).startswith(scope))
        for rule, scope, _reason in ACCEPTED_CFN_LINT
    )


@pytest.fixture
def json_snapshot(snapshot):
    return snapshot.use_extension(JSONSnapshotExtension)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_template_snapshots(synth, variant, json_snapshot):
    """cdk-nag ran inside synth: reaching this line means no unacknowledged finding."""
    for stack_name, path in sorted(synth(VARIANTS[variant]).template_files().items()):
        assert mask_asset_hashes(json.loads(path.read_text())) == json_snapshot(name=f"{variant}-{stack_name}")


@pytest.mark.slow  # cfn-lint over whole templates: 3-4 s a variant
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cfn_lint_clean(synth, variant):
    result = synth(VARIANTS[variant])
    for path in result.template_files().values():
        matches = lint_file(path, config=ManualArgs(regions=[result.config.region]))
        assert [str(m) for m in matches if not _accepted(m)] == []


def test_cfn_lint_would_catch_a_broken_template(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"Resources": {"Vpc": {"Type": "AWS::EC2::VPC", "Properties": {"CidrBlok": "10.0.0.0/16"}}}}))
    assert lint_file(broken, config=ManualArgs(regions=["us-west-2"]))


def test_asset_hash_masking_touches_only_hashes():
    h = "ab" * 32
    assert mask_asset_hashes({"S3Key": f"{h}.zip", "Name": "mltrain", "Short": "abcdef"}) == {
        "S3Key": "<asset-hash>.zip",
        "Name": "mltrain",
        "Short": "abcdef",
    }
