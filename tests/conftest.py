"""Shared fixtures: configs, in-process synthesis (cached per config), helpers."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from aws_cdk import App
from aws_cdk.assertions import Template

from config import CATALOG, PlatformConfig, parse_config
from stacks import build_platform
from stacks.app_factory import cli_context
from trainctl.backends.local_cluster import LocalEtcd
from xdist.scheduler import LoadScopeScheduling

pytest_plugins = ["tests.module_times", "tests.machine_turns"]

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "config" / "example.yaml"
# The fixed account whose AZ lookup is pre-seeded in cdk.context.json.
TEST_ACCOUNT = "123456789012"
ASSET_HASH = re.compile(r"[0-9a-f]{64}")


@pytest.fixture(autouse=True, scope="session")
def trainctl_config(tmp_path_factory):
    """trainctl has no default config (trainctl/config_source.py): the tests that run it name the
    example through $TRAINCTL_CONFIG, which their subprocesses inherit, and no test reads or
    writes the settings file of the person running the suite. Tests of the discovery itself
    remove the variable from their subprocess's environment."""
    saved = {key: os.environ.get(key) for key in ("TRAINCTL_CONFIG", "XDG_CONFIG_HOME")}
    os.environ["TRAINCTL_CONFIG"] = str(EXAMPLE.relative_to(REPO))
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("xdg-config"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def example_data() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def config_variant(**changes: Any) -> dict[str, Any]:
    """The example config with dotted-path changes, e.g. ``{"fsx.storage_capacity_gib": 2400}``."""
    data = copy.deepcopy(example_data())
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(leaf) if leaf.isdigit() else leaf] = value
    return data


class Synthesized:
    def __init__(self, config: PlatformConfig, outdir: Path):
        app = App(context=cli_context(), outdir=str(outdir))
        self.config = config
        self.platform = build_platform(app, config)
        self.assembly = app.synth()  # runs cdk-nag: an unacknowledged finding raises here

    def template(self, stack) -> Template:
        return Template.from_stack(stack)

    def template_files(self) -> dict[str, Path]:
        return {s.stack_name: Path(self.assembly.directory) / s.template_file for s in self.assembly.stacks}


@pytest.fixture(scope="session")
def synth(tmp_path_factory) -> Callable[[dict[str, Any]], Synthesized]:
    """Synthesize a config mapping in-process; equal configs are synthesized once."""
    cache: dict[str, Synthesized] = {}

    def _synth(data: dict[str, Any]) -> Synthesized:
        key = json.dumps(data, sort_keys=True)
        if key not in cache:
            cache[key] = Synthesized(parse_config(data), tmp_path_factory.mktemp("cdk.out"))
        return cache[key]

    return _synth


def mask_asset_hashes(value: Any) -> Any:
    """Replace asset hashes (64 hex characters) and nothing else."""
    if isinstance(value, str):
        return ASSET_HASH.sub("<asset-hash>", value)
    if isinstance(value, list):
        return [mask_asset_hashes(v) for v in value]
    if isinstance(value, dict):
        return {mask_asset_hashes(k): mask_asset_hashes(v) for k, v in value.items()}
    return value


# Named config variants that are synthesized, linted and snapshotted.
VARIANTS: dict[str, dict[str, Any]] = {
    "example": config_variant(),
    "pinned-account": config_variant(account=TEST_ACCOUNT),
    "no-endpoints": config_variant(**{"network.interface_endpoints": False}),
    "fsx-scratch": config_variant(
        **{"fsx.deployment_type": "SCRATCH_2", "fsx.throughput_per_tib": None, "fsx.automatic_backup_retention_days": None}
    ),
    "fsx-2400": config_variant(**{"fsx.storage_capacity_gib": 2400}),
    "fsx-4800": config_variant(**{"fsx.storage_capacity_gib": 4800, "fsx.throughput_per_tib": 500}),
    "every-family": config_variant(accelerated_node_groups=[
        {"name": "p5", "instance_type": "p5.48xlarge", "min_size": 0, "desired_size": 0, "max_size": 2},
        {"name": "trn1n", "instance_type": "trn1n.32xlarge", "min_size": 0, "desired_size": 0, "max_size": 2},
        {"name": "p3", "instance_type": "p3.8xlarge", "min_size": 0, "desired_size": 0, "max_size": 2,
         "placement_group": False, "capacity_type": "SPOT"},
        # trn2 and p5e are not offered in us-west-2 (cfn-lint's region data): p5en stands for the
        # types bought as Capacity Blocks.
        {"name": "p5en", "instance_type": "p5en.48xlarge", "min_size": 0, "desired_size": 0, "max_size": 2,
         "capacity_reservation": {"kind": "capacity_block", "id": "cr-0123456789abcdef0"}},
    ]),
    "nothing-retained": config_variant(
        **{"fsx.retain_on_delete": False, "bucket.retain_on_delete": False, "ecr.retain_on_delete": False}
    ),
    # config/batch-example.yaml: AWS Batch beside EKS for the p4d group.
    "batch": yaml.safe_load((REPO / "config" / "batch-example.yaml").read_text()),
    # config/slurm-example.yaml: AWS ParallelCluster (Slurm) beside EKS for the p4d group.
    "slurm": yaml.safe_load((REPO / "config" / "slurm-example.yaml").read_text()),
}


# Every accelerated type in the catalog, a node group each (named after its type), in one config: the
# tests of what each type's launch template holds read one synthesis, not one a type (each synthesis
# costs about a second of a core, and xdist's workers repeat what they both need).
EVERY_ACCELERATED_TYPE = config_variant(accelerated_node_groups=[
    {"name": instance_type.replace(".", "-"), "instance_type": instance_type,
     "min_size": 0, "desired_size": 0, "max_size": 2}
    for instance_type, facts in CATALOG.items() if facts.is_accelerated
])


@pytest.fixture
def etcd_server():
    """A real etcd on loopback with the v2 API, as torchrun's etcd-v2 backend needs."""
    with LocalEtcd() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def etcd_module():
    """One etcd for a module's tests; each job uses its own rendezvous id."""
    with LocalEtcd() as endpoint:
        yield endpoint


# tests/drills/ holds the tests that start real processes (torchrun agents, etcd clusters, trainers,
# the CLI as users run it, Slurm, the local SSM and S3 stand-ins), train models, or run a whole tool
# over the repository or its templates (checkov, cfn-lint, the CDK CLI); tests/unit/ holds the rest.
# The directory is the mark: `make test` runs both, `make test-fast` runs tests/unit alone (and
# `-m "not slow"` leaves the drills out of any selection); test_project_layout fails on a test module
# in neither directory.
DRILLS = REPO / "tests" / "drills"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.is_relative_to(DRILLS):
            item.add_marker(pytest.mark.slow)


# tests/unit/cdk/ holds the unit modules that build CDK constructs (test_project_layout keeps it so).
# CDK runs each process's constructs in a jsii (Node.js) runtime of its own: the first synthesis in a
# process costs about 6 s and each config about 1 s more, and xdist's workers cannot share either. So
# under `pytest -n` those modules go to one worker as one unit, which synthesizes each config once,
# while the other workers take every other unit test one by one (xdist's default). A drill module is a
# unit of its own: its module fixtures (a drill's agents, a Slurm cluster) run once, on one worker, and
# tests/machine_turns.py decides which drills may run side by side. xdist's own
# `--dist loadgroup` cannot do this under pytest 9.2: it marks a group by rewriting `item._nodeid`,
# which pytest 9.2 no longer reads (it reads `item._id`).
CDK_UNIT_TESTS = "tests/unit/cdk/"
# Drills that lint the configs' templates through the same `synth` fixture: in that unit too, they read its
# syntheses (a process's cache) instead of synthesizing every config again on another worker (about 20 s).
SYNTHESIS_READERS = ("tests/drills/test_cfn_lint.py", "tests/drills/test_checkov.py")


DRILL_TESTS = "tests/drills/"


class SuiteScopes(LoadScopeScheduling):
    """xdist's scope scheduler with three kinds of scope: all of tests/unit/cdk/ with the drills that read its
    syntheses, each other drill module, and each other unit test."""

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.startswith((CDK_UNIT_TESTS, *SYNTHESIS_READERS)):
            return CDK_UNIT_TESTS
        return nodeid.split("::", 1)[0] if nodeid.startswith(DRILL_TESTS) else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # In place of xdist's `load` (`-n` alone, or `--dist load`); any other --dist is the caller's choice.
    return SuiteScopes(config, log) if config.getoption("dist") == "load" else None
