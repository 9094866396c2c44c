"""Synthesis as users run it: the pinned CDK CLI and `python app.py`, offline, no credentials."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k8s_charts.node_runtime import HOW_TO_GET_IT

from tests.conftest import REPO

CDK = REPO / "node_modules" / ".bin" / "cdk"
# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = [pytest.mark.untimed, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory) -> dict[str, str]:
    """No AWS credentials or profile, no instance metadata, a fresh HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CDK_"))}
    env.update(
        HOME=str(tmp_path_factory.mktemp("home")),
        PATH=f"{REPO / 'node_modules' / '.bin'}:{Path(sys.executable).parent}:{env.get('PATH', '')}",
        AWS_EC2_METADATA_DISABLED="true",
        CDK_DISABLE_CLI_TELEMETRY="true",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    return env


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def python_synth(outdir: Path, env, *context: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "app.py", "-o", str(outdir)]
    for item in context:
        args += ["-c", item]
    return run(args, env)


def cli_synth(outdir: Path, env, *context: str) -> subprocess.CompletedProcess:
    assert CDK.exists(), "the pinned CDK CLI is missing: run `make test`, which installs it with npm ci"
    args = [str(CDK), "synth", "--quiet", "--output", str(outdir)]
    for item in context:
        args += ["-c", item]
    return run(args, env)


def templates(outdir: Path) -> list[str]:
    return sorted(p.name for p in outdir.glob("*.template.json"))


@pytest.fixture(scope="module")
def default_synths(tmp_path_factory, offline_env):
    """One `cdk synth` and one `python app.py` of the default config: two processes, each with its own Node.js,
    so comparing them shows both that the runs are deterministic and that the CLI adds nothing of its own."""
    outs = {name: tmp_path_factory.mktemp(name) for name in ("python", "cli")}
    # The app as from a user's plain shell: no node_modules/.bin on PATH, maybe the system's
    # end-of-life Node 20, whose 11-line banner jsii printed on every run (issue 36).
    plain_shell = {**offline_env, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    result = python_synth(outs["python"], plain_shell)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    result = cli_synth(outs["cli"], offline_env)
    assert result.returncode == 0, result.stderr
    return outs


def test_pinned_cli_version():
    result = subprocess.run([str(CDK), "--version"], capture_output=True, text=True,
                            env={**os.environ, "PATH": f"{CDK.parent}:{os.environ['PATH']}"})
    assert result.stdout.startswith("2.1148."), result.stdout


def test_default_config_synthesizes_offline(default_synths):
    assert templates(default_synths["cli"]) == [
        "mltrain-cluster.template.json",
        "mltrain-network.template.json",
        "mltrain-registry.template.json",
        "mltrain-storage.template.json",
    ]


def test_two_runs_cli_and_python_app_give_byte_identical_templates(default_synths):
    # (Until 2026-12-07 a third synthesis, a second `python app.py`, was compared with the first: this pair is two
    # runs as well, and each synthesis is about 20 core-seconds of the suite.)
    names = templates(default_synths["cli"])
    assert names and names == templates(default_synths["python"])
    _, mismatch, errors = filecmp.cmpfiles(default_synths["cli"], default_synths["python"], names, shallow=False)
    assert (mismatch, errors) == ([], [])


@pytest.fixture
def bad_config(tmp_path) -> Path:
    path = tmp_path / "bad.yaml"
    text = (REPO / "config" / "example.yaml").read_text().replace("storage_capacity_gib: 1200", "storage_capacity_gib: 1000")
    path.write_text(text)
    return path


EXPECTED_LINE = "fsx.storage_capacity_gib: got 1000; allowed: 1200, 2400 or a multiple of 2400 (4800, 7200, ...)"


def test_bad_config_python_app_one_line_no_traceback_nothing_written(tmp_path, bad_config, offline_env):
    outdir = tmp_path / "out"
    outdir.mkdir()
    (outdir / "previous.template.json").write_text("{}")
    result = python_synth(outdir, offline_env, f"config={bad_config}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"config error: {bad_config}: {EXPECTED_LINE}"]
    assert sorted(p.name for p in outdir.iterdir()) == ["previous.template.json"]


def test_bad_config_cli_fails_and_keeps_the_previous_output(tmp_path, bad_config, offline_env):
    outdir = tmp_path / "out"
    outdir.mkdir()
    (outdir / "previous.template.json").write_text("{}")
    result = cli_synth(outdir, offline_env, f"config={bad_config}")
    assert result.returncode != 0
    assert f"config error: {bad_config}: {EXPECTED_LINE}" in result.stderr.splitlines()
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in outdir.iterdir()) == ["previous.template.json"]
    assert (outdir / "previous.template.json").read_text() == "{}"


def test_python_app_without_node_is_one_line(tmp_path, offline_env):
    code = ("import os, runpy, sys; from k8s_charts import node_runtime as node; "
            "node.PINNED_NODE = node.Path('/nonexistent/node'); "
            "os.environ.pop('JSII_NODE', None); sys.argv = ['app.py', '-o', sys.argv[1]]; runpy.run_path('app.py')")
    env = {**offline_env, "PATH": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop("JSII_NODE", None)
    result = run([sys.executable, "-c", code, str(tmp_path / "out")], env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: Node.js is needed to synthesize (the AWS CDK and cdk8s run on it through jsii) and none was found; "
        f"{HOW_TO_GET_IT}"]
    assert not (tmp_path / "out").exists()


def test_python_app_rejects_malformed_context_argument(tmp_path, offline_env):
    result = python_synth(tmp_path / "out", offline_env, "config")
    assert result.returncode == 2
    assert "-c config: expected KEY=VALUE, e.g. -c config=config/example.yaml" in result.stderr
    assert "Traceback" not in result.stderr


def test_make_synth_with_a_bad_config_keeps_the_previous_output(tmp_path, bad_config, offline_env):
    outdir = tmp_path / "out"
    outdir.mkdir()
    (outdir / "previous.template.json").write_text("{}")
    result = run(["make", "--no-print-directory", "synth", f"CONFIG={bad_config}", f"OUT={outdir}"], offline_env)
    assert result.returncode != 0
    assert f"config error: {bad_config}: {EXPECTED_LINE}" in result.stderr.splitlines()
    assert sorted(p.name for p in outdir.iterdir()) == ["previous.template.json"]


def team_config(tmp_path: Path) -> Path:
    """A team's config whose node groups are not named like the example's (p4d, trn1)."""
    text = (REPO / "config" / "example.yaml").read_text()
    path = tmp_path / "my-team.yaml"
    path.write_text(text.replace("name: p4d", "name: a100").replace("name: trn1", "name: trainium"))
    assert path.read_text() != text
    return path


def test_make_synth_with_a_team_config_renders_its_jobs_not_the_examples(tmp_path, offline_env):
    """The examples name the example's node groups; a team's config rendered them by default and
    failed, the first command of the README's deploy section (issue 36)."""
    config = team_config(tmp_path)
    dry = run(["make", "--no-print-directory", "-n", "synth", f"CONFIG={config}"], offline_env)
    render = [line for line in dry.stdout.splitlines() if "-m k8s_charts" in line]
    assert dry.returncode == 0 and len(render) == 1 and "--job" not in render[0], dry.stdout
    with_examples = run(["make", "--no-print-directory", "-n", "synth"], offline_env).stdout
    assert "--job k8s_charts/examples/resnet50-p4d.yaml" in with_examples


def test_make_synth_with_a_bad_job_keeps_both_previous_outputs(tmp_path, offline_env):
    outdir, dist = tmp_path / "out", tmp_path / "dist"
    for folder, name in ((outdir, "previous.template.json"), (dist, "previous.yaml")):
        folder.mkdir()
        (folder / name).write_text("{}")
    result = run(["make", "--no-print-directory", "synth", f"CONFIG={team_config(tmp_path)}", f"OUT={outdir}",
                  f"DIST={dist}", "JOBS=k8s_charts/examples/resnet50-p4d.yaml"], offline_env)
    assert result.returncode != 0
    assert "node_group: got \"p4d\" (not a node group of this platform); allowed: a100, trainium" in result.stderr
    assert [p.name for p in outdir.iterdir()] == ["previous.template.json"]
    assert [p.name for p in dist.iterdir()] == ["previous.yaml"]


def test_make_diff_offline_reviews_every_stack_against_the_deployed_templates(tmp_path, default_synths, offline_env):
    """The README's offline review: `cdk diff --all` reads the deployed stacks and fails without
    credentials; `make diff-offline` diffs each stack of a synth against kept templates."""
    import json
    import shutil

    deployed = tmp_path / "deployed"
    shutil.copytree(default_synths["python"], deployed)
    template = deployed / "mltrain-storage.template.json"
    data = json.loads(template.read_text())
    data["Resources"]["RemovedSinceTheDeploy"] = {"Type": "AWS::SNS::Topic", "Properties": {}}
    template.write_text(json.dumps(data))
    # -o synth: the synth this target depends on is default_synths' (make synth is tested above).
    result = run(["make", "--no-print-directory", "-o", "synth", "diff-offline", f"OUT={default_synths['cli']}",
                  f"DEPLOYED={deployed}"], offline_env)
    assert result.returncode != 0
    assert "mltrain-storage: AWS::SNS::Topic RemovedSinceTheDeploy will be destroyed" in result.stderr + result.stdout
    missing = run(["make", "--no-print-directory", "-o", "synth", "diff-offline", f"DEPLOYED={tmp_path / 'none'}"],
                  offline_env)
    assert missing.returncode == 2 and f"DEPLOYED={tmp_path / 'none'}: no such folder" in missing.stderr
