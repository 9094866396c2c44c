"""Every synthesized template: snapshot (asset hashes masked) and cdk-nag (cfn-lint: tests/drills/test_cfn_lint.py)."""

from __future__ import annotations

import json

import pytest
from syrupy.extensions.json import JSONSnapshotExtension

from tests.conftest import VARIANTS, mask_asset_hashes

@pytest.fixture
def json_snapshot(snapshot):
    return snapshot.use_extension(JSONSnapshotExtension)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_template_snapshots(synth, variant, json_snapshot):
    """cdk-nag ran inside synth: reaching this line means no unacknowledged finding."""
    for stack_name, path in sorted(synth(VARIANTS[variant]).template_files().items()):
        assert mask_asset_hashes(json.loads(path.read_text())) == json_snapshot(name=f"{variant}-{stack_name}")


def test_asset_hash_masking_touches_only_hashes():
    h = "ab" * 32
    assert mask_asset_hashes({"S3Key": f"{h}.zip", "Name": "mltrain", "Short": "abcdef"}) == {
        "S3Key": "<asset-hash>.zip",
        "Name": "mltrain",
        "Short": "abcdef",
    }
