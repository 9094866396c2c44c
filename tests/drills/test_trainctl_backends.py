"""Every trainctl backend through the same cases (trainctl/backends/__init__.py, the one interface).

1. An option a backend does not declare is refused in one line, for every backend, command and
   option trainctl has, before the backend is built (nothing is contacted); the line says which
   backend takes it instead.
2. The same job through each backend, each against the real thing or its stand-in: the loopback API
   server (eks), moto (batch), Debian's slurmctld and slurmd on loopback (slurm), real agents and
   etcd on this machine (local). ``submit --wait`` exits 0 once the job succeeded; ``status -o json``
   and ``-o yaml`` give the same mapping, which says the job finished; ``status --watch`` of an ended
   job returns; ``list -o json`` is a list of mappings with ``name`` and ``state``; a job that is not
   there is one line, for status, logs and cancel alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests import trainctl_fixtures
from tests.conftest import REPO
from tests.slurm_cluster import SlurmCluster, missing
from tests.unit.cdk import test_batch
from tests.trainctl_fixtures import one_error
from trainctl.__main__ import build_parser, main
from trainctl.backends import BACKENDS, JOB_COMMANDS, load
from tests.drill_harness import GLOBAL_BATCH

# fixtures bound by name, as pytest finds them (tests/trainctl_fixtures.py)
server = trainctl_fixtures.server
aws_batch, batch_template = test_batch.aws_batch, test_batch.batch_template
EXAMPLE_CONFIG = str(REPO / "config" / "example.yaml")
RESNET = str(REPO / "k8s_charts" / "examples" / "resnet50-p4d.yaml")
# A value each option takes, where it takes one.
VALUES = {"--rank": "1", "--pod": "1", "--since": "10m", "--python": "/usr/bin/python3", "--nodes": "1",
          "--nproc-per-node": "1", "--workdir": "/tmp/nowhere", "-o": "json", "--dry-run=server": None}
ARGUMENTS = {"submit": [RESNET], "status": ["job-a"], "logs": ["job-a"], "cancel": ["job-a"], "list": []}


def options_of(command: str) -> set[str]:
    """The options of ``command`` a backend may or may not honour, as Backend.options spells them."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    spelled = set()
    for action in sub._actions:
        if action.option_strings and action.dest not in ("config", "profile", "context", "backend", "help", "interval"):
            spelled.add("-o" if action.dest == "output" else max(action.option_strings, key=len))
    return spelled | ({"--dry-run=server"} if command == "submit" else set())


def test_every_declared_option_is_one_trainctl_has_and_every_backend_answers_every_command():
    for name in BACKENDS:
        backend = load(name)
        assert backend.name == name
        for command, declared in backend.options.items():
            assert command in JOB_COMMANDS and declared <= options_of(command), (name, command, declared)
        assert not backend.__abstractmethods__, (name, backend.__abstractmethods__)  # it answers every command


CASES = [(name, command, option) for name in BACKENDS for command in JOB_COMMANDS
         for option in sorted(options_of(command) - load(name).options.get(command, frozenset()))]


@pytest.mark.parametrize("backend, command, option", CASES, ids=[f"{b}-{c}-{o}" for b, c, o in CASES])
def test_an_option_a_backend_does_not_honour_is_one_line_before_the_backend_is_built(
        backend, command, option, monkeypatch, capsys):
    monkeypatch.setattr(load(backend), "__init__", lambda *a: pytest.fail(f"{backend} was built"))
    typed = [option] if VALUES.get(option) is None else [option, VALUES[option]]
    code = main(["--config", EXAMPLE_CONFIG, command, *ARGUMENTS[command], *typed, "--backend", backend])
    error = one_error(capsys.readouterr().err)
    shown = "-o json" if option == "-o" else option
    takers = [other for other in BACKENDS if option in load(other).options.get(command, ())]
    assert code == 2 and error.startswith(f"error: {command} --backend {backend}: got {shown}; fix: allowed with "
                                          f"{backend}: "), error
    assert error.endswith(f"; {shown} is for --backend {' or '.join(takers)}") if takers else True, error


# --- the same job through each backend ------------------------------------------------------------

def tiny_job(name: str, node_group: str) -> dict:
    """The drills' MLP, a few steps: what every backend can run to its end here."""
    return {
        "name": name, "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainer:gpu-0.1.0",
        "node_group": node_group, "min_nodes": 1, "max_nodes": 1, "checkpoint_path": f"/fsx/{name}/checkpoints",
        "trainer_args": {
            "model.name": "mlp", "model.image_size": 16, "model.num_classes": 10, "eval.enabled": False,
            "data.synthetic_samples": GLOBAL_BATCH * 10, "data.num_workers": 0, "train.global_batch_size": GLOBAL_BATCH,
            "train.micro_batch_size": 16, "train.epochs": 1, "train.precision": "fp32", "train.device": "cpu",
            "checkpoint.interval_steps": 5,
        },
    }


def in_process(*argv: str) -> tuple[int, str, str]:
    """trainctl in this process (moto's mock is this process's)."""
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    out, err = StringIO(), StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def eks(server, tmp_path):
    server.phases = ["Pending", "Running", "Completed"]
    run = trainctl_fixtures.cli.__wrapped__(server, tmp_path)  # as users run it, KUBECONFIG naming the server
    return lambda *argv: run("--config", EXAMPLE_CONFIG, *argv, "--context", "lab"), RESNET, "resnet50-imagenet"


@pytest.fixture
def batch(aws_batch, tmp_path):
    from tests.conftest import VARIANTS

    config = tmp_path / "batch.yaml"
    config.write_text(yaml.safe_dump(VARIANTS["batch"]))
    return lambda *argv: in_process("--config", str(config), *argv, "--backend", "batch"), RESNET, "resnet50-imagenet"


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    if missing() is not None:
        pytest.skip(f"no real Slurm here: {missing()}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), partition="g5").start()
    raw = yaml.safe_load((REPO / "config/example.yaml").read_text())
    raw["accelerated_node_groups"].append(
        {"name": "g5", "instance_type": "g5.xlarge", "min_size": 0, "desired_size": 0, "max_size": 2})
    raw["slurm"] = {"queues": [{"node_group": "g5"}]}
    (cluster.root / "platform.yaml").write_text(yaml.safe_dump(raw))
    yield cluster
    cluster.stop()


def subprocess_cli(prefix: list[str], wrap=lambda argv: argv):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

    def run(*argv: str) -> tuple[int, str, str]:
        done = subprocess.run(wrap([sys.executable, "-m", "trainctl", *prefix, *argv]), cwd=REPO,
                              capture_output=True, text=True, timeout=300, env=env)
        return done.returncode, done.stdout, done.stderr

    return run


@pytest.fixture
def slurm(slurm_cluster):
    spec = slurm_cluster.root / "contract.yaml"
    spec.write_text(yaml.safe_dump(tiny_job("contract", "g5")))
    run = subprocess_cli(["--config", str(slurm_cluster.root / "platform.yaml")], slurm_cluster.head_node)

    def cli(*argv: str):
        extra = ["--python", sys.executable] if argv[0] == "submit" else []
        return run(*argv, *extra, "--backend", "slurm", "--on-head-node")

    return cli, str(spec), "contract"


@pytest.fixture
def local(tmp_path):
    spec = tmp_path / "contract.yaml"
    spec.write_text(yaml.safe_dump(tiny_job("contract", "p4d")))
    run = subprocess_cli(["--config", EXAMPLE_CONFIG])

    def cli(*argv: str):
        return run(*argv, "--backend", "local", "--workdir", str(tmp_path / "work"))

    return cli, str(spec), "contract"


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_same_job_through_every_backend(backend, request):
    cli, spec, name = request.getfixturevalue(backend)
    code, out, err = cli("submit", spec, "--wait", "--interval", "0.2")
    assert code == 0, (out, err)
    code, as_json, err = cli("status", name, "-o", "json")
    assert code == 0, err
    report = json.loads(as_json)
    assert report == yaml.safe_load(cli("status", name, "-o", "yaml")[1])
    assert report["name"] == name and report["finished"] is True
    code, text, _ = cli("status", name, "--watch")
    assert code == 0 and name in text.splitlines()[0]  # an ended job: one report, then back
    code, rows, err = cli("list", "-o", "json")
    assert code == 0 and all({"name", "state"} <= set(row) for row in json.loads(rows)), (rows, err)
    for command in (["status", "not-there"], ["logs", "not-there"], ["cancel", "not-there"]):
        code, _, err = cli(*command)
        assert code == 2 and "not-there" in one_error(err), (command, err)
