"""``trainctl ... --backend slurm`` before it reaches a cluster: the printed script, and every mistake as
one line. The real Slurm runs: tests/drills/test_slurm_requeue.py."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.trainctl_fixtures import one_error
from trainctl.__main__ import main
from trainctl.backends.eks import EksBackend
from trainctl.backends.slurm import SlurmBackend, render_for
from config import load_config
from config.job_spec import load_job_spec

SLURM_CONFIG = str(REPO / "config" / "slurm-example.yaml")
EXAMPLE_CONFIG = str(REPO / "config" / "example.yaml")
RESNET = str(REPO / "k8s_charts" / "examples" / "resnet50-p4d.yaml")


def one_line(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    return one_error(err)


def test_dry_run_prints_the_script_and_contacts_nothing(capsys, monkeypatch):
    monkeypatch.setattr(SlurmBackend, "client", property(lambda self: pytest.fail("a dry run contacted the cluster")))
    assert main(["--config", SLURM_CONFIG, "submit", RESNET, "--backend", "slurm", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    config = load_config(SLURM_CONFIG)
    assert out == render_for(config, load_job_spec(RESNET, config))
    assert out.startswith("#!/bin/bash\n") and "#SBATCH --partition=p4d" in out
    assert err.startswith("trainctl: config ") and "Slurm cluster mltrain-slurm-cluster in us-west-2" in err


@pytest.mark.parametrize("argv, expected", [
    (["--config", EXAMPLE_CONFIG, "status", "x", "--backend", "slurm"],
     "error: --backend slurm: this platform has no slurm section; fix: add `slurm: {queues: [{node_group: ...}]}` "
     "to the config and deploy (see config/slurm-example.yaml)"),
    (["--config", SLURM_CONFIG, "submit", str(REPO / "k8s_charts/examples/bert-trn1.yaml"), "--backend", "slurm"],
     "error: node_group: got 'trn1', which has no Slurm queue; fix: allowed with --backend slurm: p4d "
     "(slurm.queues in the platform config)"),
    (["--config", SLURM_CONFIG, "submit", RESNET, "--backend", "slurm", "--replace"],
     "error: submit --backend slurm: got --replace; fix: allowed with slurm: --dry-run, --on-head-node, --python, "
     "--wait (--dry-run prints the sbatch script); --replace is for --backend eks or batch or local"),
    (["--config", SLURM_CONFIG, "submit", RESNET, "--backend", "slurm", "--dry-run=server"],
     "error: submit --backend slurm: got --dry-run=server; fix: allowed with slurm: --dry-run, --on-head-node, "
     "--python, --wait (--dry-run prints the sbatch script); --dry-run=server is for --backend eks"),
    (["--config", SLURM_CONFIG, "cancel", "--all", "--backend", "slurm"],
     "error: cancel --backend slurm: got --all; fix: allowed with slurm: --on-head-node; --all is for --backend eks"),
    (["--config", SLURM_CONFIG, "cancel", "--backend", "slurm"],
     "error: cancel: got neither a name nor --all; fix: allowed: `trainctl cancel NAME`"),
    (["--config", SLURM_CONFIG, "logs", "x", "--follow", "--backend", "slurm"],
     "error: logs --backend slurm: got --follow; fix: allowed with slurm: --on-head-node, --pod, --rank (each node's "
     "log file on /fsx, every incarnation appended); --follow is for --backend eks or local"),
    (["--config", SLURM_CONFIG, "submit", RESNET, "--python", "/usr/bin/python3"],
     "error: submit --backend eks: got --python; fix: allowed with eks: --dry-run, --dry-run=server, --follow, "
     "--nccl-check, --replace, --wait; --python is for --backend slurm"),
    (["--config", SLURM_CONFIG, "status", "x", "--on-head-node"],
     "error: status --backend eks: got --on-head-node; fix: allowed with eks: --watch, -o; --on-head-node is for "
     "--backend slurm"),
])
def test_mistakes_are_one_line_before_any_cluster_is_reached(capsys, monkeypatch, argv, expected):
    monkeypatch.setattr(SlurmBackend, "client", property(lambda self: pytest.fail("reached for the cluster")))
    monkeypatch.setattr(EksBackend, "client", property(lambda self: pytest.fail("reached for EKS")))
    assert one_line(capsys, *argv).removesuffix(f" [config {argv[1]} (from --config)]") == expected
