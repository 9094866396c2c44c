"""Which checkpoint a job resumes from: one reader, one decision for all ranks, and a refusal in
one line (not a traceback at every restart) when the directory holds something this job cannot
use. Real trainer processes, under the real launcher where the exit status matters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from training.contract import EXIT_CONFIG, EXIT_DIVERGED

# untimed (tests/machine_turns.py): no deadline (a refused launch's restarts are counted by the checkpoint's reads),
# so make test runs it beside the timed drills, on the CPU they leave idle (tests/background.py)
pytestmark = [pytest.mark.untimed, pytest.mark.timeout(300)]

# Run at the start of every interpreter of the launch (a sitecustomize): the agent, the forkserver its
# workers come from (training/launcher/workers.py), and so every worker: which rank opens which checkpoint.
AUDIT_HOOK = textwrap.dedent("""
    import os, sys
    if os.environ.get("AUDIT_FILE"):
        fd = os.open(os.environ["AUDIT_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        def hook(event, args):
            if event != "open":
                return
            path, mode = args[0], args[1]
            path = os.fspath(path) if isinstance(path, os.PathLike) else path
            if isinstance(path, str) and "/checkpoints/step-" in path and isinstance(mode, str) and "r" in mode:
                os.write(fd, f"{os.environ.get('RANK', '-')} {os.path.basename(path)}\\n".encode())
        sys.addaudithook(hook)
""")


def trainer_args(work: Path, *extra: str, steps: int = 10, interval: int = 5) -> list[str]:
    return [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=4", "--data.synthetic_samples=4096",
        "--data.num_workers=0", "--train.global_batch_size=16", "--train.micro_batch_size=8",
        f"--train.max_steps={steps}", "--train.log_every_steps=1", "--train.precision=fp32", "--train.device=cpu",
        f"--checkpoint.dir={work}/checkpoints", f"--checkpoint.interval_steps={interval}",
        "--checkpoint.async_save=false", f"--metrics.jsonl_path={work}/metrics.jsonl",
        f"--metrics.sample_log_dir={work}/samples", *extra,
    ]


def train(work: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """``python -m training train`` alone, as on a workstation."""
    return subprocess.run([sys.executable, "-m", "training", "train", *trainer_args(work, *args, **kwargs)],
                          cwd=REPO, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})


def launch(work: Path, nproc: int, *args: str, audit: Path | None = None, max_restarts: int = 3,
           **kwargs) -> subprocess.CompletedProcess:
    """The platform launcher on one node with ``nproc`` workers, as a pod runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if audit:
        hook = audit.parent / "audit-hook"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(AUDIT_HOOK)
        env.update(AUDIT_FILE=str(audit), PYTHONPATH=os.pathsep.join([str(hook), str(REPO)]))
    command = [sys.executable, "-m", "training.launcher", "--standalone", f"--nproc-per-node={nproc}",
               "--start-method=forkserver", f"--max-restarts={max_restarts}", "--monitor-interval=0.2", "-m",
               "training", "train", *trainer_args(work, *args, **kwargs)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240, env=env)


def events(work: Path, kind: str) -> list[dict]:
    lines = (work / "metrics.jsonl").read_text().splitlines() if (work / "metrics.jsonl").exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith(("error:", "config error:"))]


def test_one_rank_reads_the_checkpoint_and_every_rank_resumes_the_same_step(tmp_path):
    first = launch(tmp_path, 2)
    assert first.returncode == 0, first.stderr[-3000:]
    newest = tmp_path / "checkpoints" / "step-000000010.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # torn: every rank must fall back, together

    opens = tmp_path / "opens.log"
    second = launch(tmp_path, 2, audit=opens, steps=14)
    assert second.returncode == 0, second.stderr[-3000:]
    # Rank 0 alone read (the torn file, then the one before); the state reached rank 1 by broadcast.
    opened = [line.split() for line in opens.read_text().splitlines()]
    assert {rank for rank, _ in opened} == {"0"}
    assert {name for _, name in opened} == {"step-000000010.pt", "step-000000005.pt"}
    assert opened[-1][1] == "step-000000005.pt"
    resume = events(tmp_path, "resume")[-1]
    assert resume["step"] == 5 and resume["skipped_unreadable"][0].startswith("step-000000010.pt: ")
    assert resume["bytes_read"] == (tmp_path / "checkpoints" / "step-000000005.pt").stat().st_size
    attempt = events(tmp_path, "rendezvous")[-1]["attempt"]
    first_steps = {rank: json.loads((tmp_path / "samples" / f"samples-{attempt}-rank{rank}.jsonl")
                                    .read_text().splitlines()[0])["step"] for rank in (0, 1)}
    assert first_steps == {0: 5, 1: 5}


@pytest.mark.parametrize(("change", "difference"), [
    ("--model.image_size=32", "model.image_size 16 there, 32 here"),
    ("--optim.name=adamw", "optim.name 'sgd' there, 'adamw' here"),
    ("--model.name=resnet18", "model.name 'mlp' there, 'resnet18' here"),
])
def test_a_checkpoint_of_another_model_or_optimizer_is_one_line(tmp_path, change, difference):
    assert train(tmp_path, steps=2, interval=1).returncode == 0
    result = train(tmp_path, change, steps=4)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = error_lines(result)
    assert line.startswith(f"error: checkpoint.dir: {tmp_path}/checkpoints/step-000000002.pt does not fit this job: ")
    assert difference in line and line.endswith(
        "allowed: another checkpoint.dir, or checkpoint.if_unusable=start_fresh to set them aside and start at step 0")
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == [
        "step-000000001.pt", "step-000000002.pt"]  # nothing touched


def test_under_the_launcher_such_a_refusal_ends_the_job_without_a_restart(tmp_path):
    assert train(tmp_path, steps=2, interval=1).returncode == 0
    opens = tmp_path / "opens.txt"
    result = launch(tmp_path, 2, "--optim.name=adamw", audit=opens, steps=4, max_restarts=5)
    assert result.returncode == EXIT_CONFIG, result.stderr[-3000:]
    # torchrun restarted nothing: the checkpoint was read once, by the reader rank. (torch's "attempts left" line
    # is logged below the launcher's level, so its absence from stderr showed nothing; and a deadline, "within
    # 60 s where one attempt takes 8", fails on a busy machine: make test runs this module at the lowest
    # priority, tests/background.py.)
    assert opens.read_text().splitlines() == ["0 step-000000002.pt"]
    assert {line.split("does not fit this job: ")[1] for line in error_lines(result)} == {
        "optim.name 'sgd' there, 'adamw' here; allowed: another checkpoint.dir, or checkpoint.if_unusable="
        "start_fresh to set them aside and start at step 0"}  # every rank said the same


def test_an_unusable_checkpoint_dir_is_found_before_the_first_step(tmp_path):
    (tmp_path / "file").write_text("x")
    result = subprocess.run([sys.executable, "-m", "training", "train", *trainer_args(tmp_path),
                             f"--checkpoint.dir={tmp_path}/file/checkpoints"],
                            cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == [f"error: checkpoint.dir: cannot create {tmp_path}/file/checkpoints (Not a "
                                   "directory); allowed: a writable directory on the shared file system"]
    assert not events(tmp_path, "step") and not events(tmp_path, "checkpoint_started")


def test_when_no_checkpoint_can_be_read_it_refuses_unless_told_to_start_fresh(tmp_path):
    assert train(tmp_path, steps=4, interval=2).returncode == 0
    for path in (tmp_path / "checkpoints").glob("step-*.pt"):
        path.write_bytes(b"\0" * 64)
    refused = train(tmp_path, steps=6)
    assert refused.returncode == 2
    (line,) = error_lines(refused)
    assert line.startswith(f"error: checkpoint.dir: none of the 2 checkpoint(s) in {tmp_path}/checkpoints can be "
                           "read (newest step-000000004.pt: ")
    assert len(list((tmp_path / "checkpoints").glob("step-*.pt"))) == 2  # left as they were

    fresh = train(tmp_path, "--checkpoint.if_unusable=start_fresh", steps=6)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    start = events(tmp_path, "start")[-1]
    aside = Path(start["set_aside"])
    assert start["step"] == 0 and aside.parent == tmp_path / "checkpoints" / "set-aside"
    assert sorted(p.name for p in aside.iterdir()) == ["step-000000002.pt", "step-000000004.pt"]
    assert events(tmp_path, "finished")[-1]["step"] == 6


@pytest.mark.parametrize("keep_last", [1, 2])
def test_a_job_resumed_past_torn_checkpoints_keeps_what_it_saves(tmp_path, keep_last):
    """Steps 4 and 6 torn: the job resumes from 2 and saves 3. Retention counting the torn files
    toward keep_last kept them and deleted step 3, the one it had just written."""
    assert train(tmp_path, steps=6, interval=2).returncode == 0
    for step in (4, 6):
        path = tmp_path / "checkpoints" / f"step-00000000{step}.pt"
        path.write_bytes(path.read_bytes()[:100])
    resumed = train(tmp_path, f"--checkpoint.keep_last={keep_last}", steps=3, interval=2)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert events(tmp_path, "resume")[-1]["step"] == 2
    on_disk = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*.pt"))
    assert on_disk == (["step-000000003.pt"] if keep_last == 1 else ["step-000000002.pt", "step-000000003.pt"])
    assert torch.load(tmp_path / "checkpoints" / "step-000000003.pt", weights_only=True)["progress"]["step"] == 3
    (moved,) = events(tmp_path, "checkpoints_set_aside")
    assert sorted(p.name for p in Path(moved["path"]).iterdir()) == ["step-000000004.pt", "step-000000006.pt"]
    assert [f.split(":")[0] for f in moved["files"]] == ["step-000000006.pt", "step-000000004.pt"]
    assert "moved 2 unreadable checkpoint(s)" in resumed.stderr


def test_a_non_finite_loss_stops_with_its_own_status_and_saves_nothing(tmp_path):
    assert train(tmp_path, steps=4, interval=2).returncode == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").glob("step-*.pt")}
    result = train(tmp_path, "--optim.lr=1e30", "--checkpoint.keep_last=1", steps=40, interval=1)
    assert result.returncode == EXIT_DIVERGED and "Traceback" not in result.stderr
    (line,) = error_lines(result)
    assert line.startswith("error: the loss is not finite at step ") and "lower optim.lr" in line
    after = sorted((tmp_path / "checkpoints").glob("step-*.pt"))
    for path in after:  # whatever was saved is finite, and nothing good was pruned for a bad state
        state = torch.load(path, weights_only=True)
        assert all(torch.isfinite(t).all() for t in state["model"].values()), path.name
    assert set(before) <= {p.name for p in after} or len(after) == 1 and after[0].name > max(before)


def test_every_rank_sees_the_divergence_in_the_step_agreement_and_nothing_retries_it(tmp_path):
    result = launch(tmp_path, 2, "--optim.lr=1e30", steps=60, interval=100, max_restarts=5)
    assert result.returncode == EXIT_DIVERGED, result.stderr[-3000:]
    assert "attempts left" not in result.stderr
    lines = error_lines(result)
    assert len(lines) == 2 and len({line.split(" at step ")[1] for line in lines}) == 1  # both, same step
    assert not list((tmp_path / "checkpoints").glob("step-*.pt"))
