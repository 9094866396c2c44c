"""Config mistakes are caught at synth, in one line, before anything is written (issue 17, item 6)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from aws_cdk.assertions import Annotations, Match

from config import parse_config
from config.regions import AVAILABILITY_ZONES
from tests.conftest import REPO, config_variant
from typed_config import ConfigError


def test_the_az_table_is_motos_region_data():
    from moto.ec2.models.availability_zones_and_regions import RegionsAndZonesBackend

    moto = {region: "".join(sorted(zone.name.removeprefix(region) for zone in zones))
            for region, zones in RegionsAndZonesBackend.zones.items()}
    assert moto == AVAILABILITY_ZONES


def one_problem(**changes) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(config_variant(**changes))
    assert len(caught.value.problems) == 1, caught.value.problems
    return caught.value.problems[0]


@pytest.mark.parametrize(("changes", "line"), [
    ({"compute_az": "us-west-2e"}, 'compute_az: got "us-west-2e" (us-west-2 has no such Availability Zone); '
                                   "allowed: us-west-2a, us-west-2b, us-west-2c, us-west-2d"),
    ({"region": "us-east-1", "compute_az": "us-east-1g", "control_plane_az": "us-east-1a"},
     'compute_az: got "us-east-1g" (us-east-1 has no such Availability Zone); allowed: us-east-1a, us-east-1b, '
     "us-east-1c, us-east-1d, us-east-1e, us-east-1f"),
    ({"accelerated_node_groups.0.max_size": 4000},
     "accelerated_node_groups[0].max_size: got 4000 (EKS's quota 'Nodes per managed node group' is 450 unless "
     "raised); allowed: 1 to 450"),
    ({"system_node_group.max_size": 451}, "system_node_group.max_size: got 451 (EKS's quota"),
    ({"tags": {"aws:team": "ml"}}, 'tags.aws:team: got "aws:team"; allowed: a key that does not start with aws: '
                                   "(AWS reserves that prefix)"),
    ({"tags": {"AWS:Team": "ml"}}, 'tags.AWS:Team: got "AWS:Team"; allowed: a key that does not start with aws:'),
    ({"tags": {"team": "ml|research"}}, 'tags.team: got "ml|research"; allowed: letters, digits, spaces and '
                                        "_ . : / = + - @ (AWS tag rules)"),
    ({"tags": {"cost<center>": "1"}}, 'tags.cost<center>: got "cost<center>"; allowed: letters, digits'),
    ({"tags": {"platform": "x"}}, 'tags.platform: got "platform" (the platform sets this tag itself); '
                                  "allowed: another key"),
    ({"tags": {f"k{i}": "v" for i in range(50)}}, 'tags: got "50 tags" (AWS allows 50 per resource and the '
                                                  "platform adds platform); allowed: at most 49"),
])
def test_each_mistake_is_one_line_naming_field_value_and_what_is_allowed(changes, line):
    assert one_problem(**changes).startswith(line)


def test_good_tags_and_a_region_the_table_does_not_know_pass():
    parse_config(config_variant(tags={f"k{i}": "v" for i in range(48)} | {"team/ml": "a b+c=d@e.f:g_h-i"}))
    parse_config(config_variant(region="xx-newregion-1", compute_az="xx-newregion-1a",
                                control_plane_az="xx-newregion-1b"))


def test_synth_of_a_bad_config_is_one_line_and_writes_nothing(tmp_path):
    data = config_variant(tags={"aws:team": "ml"})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "cdk.out"
    result = subprocess.run([sys.executable, "app.py", "-c", f"config={path}", "-o", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PATH": f"{REPO / 'node_modules' / '.bin'}:{os.environ['PATH']}"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f'config error: {path}: tags.aws:team: got "aws:team"; allowed: a key that does not start with aws: '
        "(AWS reserves that prefix)"]
    assert not out.exists()


def test_an_api_endpoint_open_to_the_internet_is_a_synth_warning(synth):
    result = synth(config_variant(**{"cluster.endpoint_access_cidrs": ["0.0.0.0/0"]}))
    Annotations.from_stack(result.platform.cluster).has_warning(
        "*", Match.string_like_regexp(r"cluster.endpoint_access_cidrs contains 0.0.0.0/0"))
    closed = synth(config_variant())
    assert not Annotations.from_stack(closed.platform.cluster).find_warning(
        "*", Match.string_like_regexp(r"0.0.0.0/0"))
