"""cfn-lint over every synthesized template, the pipeline's stages included (3-10 s a template set).

With the snapshots and cdk-nag in tests/unit/cdk/test_templates.py; here because it runs a whole tool
over whole templates, as checkov does in test_checkov.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from cfnlint.api import ManualArgs, lint_file

from tests.conftest import VARIANTS
from tests.unit.cdk.test_pipeline_stack import synth_pipeline

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = pytest.mark.untimed

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


# Findings by the template's bytes and region: the variants' 42 templates are 23 distinct ones (a variant changes
# one to three stacks and leaves the others byte for byte the example's), and cfn-lint takes 0.5 to 2 s a
# template. Every distinct template is still linted.
_FINDINGS: dict[tuple[str, str], list[str]] = {}


def findings(path: Path, region: str) -> list[str]:
    key = (hashlib.sha256(path.read_bytes()).hexdigest(), region)
    if key not in _FINDINGS:
        _FINDINGS[key] = [str(m) for m in lint_file(path, config=ManualArgs(regions=[region])) if not _accepted(m)]
    return _FINDINGS[key]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cfn_lint_clean(synth, variant):
    result = synth(VARIANTS[variant])
    for path in result.template_files().values():
        assert findings(path, result.config.region) == []


def test_cfn_lint_would_catch_a_broken_template(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"Resources": {"Vpc": {"Type": "AWS::EC2::VPC", "Properties": {"CidrBlok": "10.0.0.0/16"}}}}))
    assert lint_file(broken, config=ManualArgs(regions=["us-west-2"]))


def test_cfn_lint_clean_for_the_pipeline_and_its_stages(tmp_path):
    _, _, _, outdir = synth_pipeline(tmp_path)
    paths = [outdir / "mltrain-pipeline.template.json", *sorted(outdir.glob("assembly-*/*.template.json"))]
    assert len(paths) == 9  # the pipeline, and four platform stacks in each of two stages
    for path in paths:
        assert findings(path, "us-west-2") == []
