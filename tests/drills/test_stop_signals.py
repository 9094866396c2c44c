"""Ctrl-C and SIGTERM to a whole process group stop cleanly (issue 36, item 6).

A terminal's Ctrl-C, ``kill -- -PGID``, systemd, Slurm's scancel and ``docker stop`` signal every
process of the group: the trainer, its DataLoader workers and, under the launcher, the agent and
its workers. Whatever gets the signal, the run says so once, saves a stop checkpoint, and exits
with 128 + the signal's number; a rerun resumes from that checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from training.contract import EXIT_STOPPED
from tests.drill_harness import trainer_args
from trainctl.backends.local_cluster import Agent, LocalEtcd, read_events, wait_until
from training.loop.checkpoint import SLOW_WRITE_ENV

CTRL_C = "Ctrl-C: saving a checkpoint at the end of this step, then stopping"


def standalone_args(work: Path, max_steps: int = 100000) -> list[str]:
    """The trainer on CPU with two DataLoader workers, which share the trainer's process group."""
    return [sys.executable, "-m", "training", "train", "--model.name=mlp", "--model.image_size=16",
            "--model.num_classes=4", "--data.synthetic_samples=100000", "--data.num_workers=2",
            "--train.global_batch_size=16", "--train.micro_batch_size=16", f"--train.max_steps={max_steps}",
            "--train.log_every_steps=2", "--train.precision=fp32", "--train.device=cpu", "--eval.enabled=false",
            f"--checkpoint.dir={work}/checkpoints", f"--metrics.jsonl_path={work}/metrics.jsonl"]


def env(**extra: str) -> dict[str, str]:
    # PYTHONPATH: this checkout's trainer, not whichever one an editable install points at.
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def trained(work: Path) -> bool:
    return any(e["event"] == "step" for e in read_events(work / "metrics.jsonl"))


def the_stop(work: Path) -> dict:
    """The run's stop record; its checkpoint is on disk, at the step it stopped."""
    stops = [e for e in read_events(work / "metrics.jsonl") if e["event"] == "stop"]
    assert len(stops) == 1, stops
    stop = stops[0]
    assert stop["checkpoint"] and Path(stop["checkpoint"]).name == f"step-{stop['step']:09d}.pt"
    assert Path(stop["checkpoint"]).is_file()
    return stop


def group_gone(pgid: int) -> bool:
    """No process is left in the group (loader workers included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def run_alone_and_signal(work: Path, signum: int) -> tuple[int, str]:
    process = subprocess.Popen(standalone_args(work), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=env(), start_new_session=True)
    try:
        wait_until(lambda: trained(work) or process.poll() is not None, "a trained step", 120)
        assert process.poll() is None, process.communicate()[1]
        os.killpg(process.pid, signum)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    wait_until(lambda: group_gone(process.pid), "the loader workers to exit", 30)
    return process.returncode, err


def test_ctrl_c_to_the_group_says_so_once_checkpoints_exits_130_and_resumes(tmp_path):
    code, err = run_alone_and_signal(tmp_path, signal.SIGINT)
    # Once, not once per loader worker; and none of the loader's "worker killed" errors.
    assert err.count(CTRL_C) == 1, err
    assert "Traceback" not in err, err
    assert code == 128 + signal.SIGINT
    stop = the_stop(tmp_path)
    assert stop["signal"] == "SIGINT"

    resumed = subprocess.run(standalone_args(tmp_path, max_steps=stop["step"] + 2), cwd=REPO, env=env(),
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    resumes = [e for e in read_events(tmp_path / "metrics.jsonl") if e["event"] == "resume"]
    assert [(e["step"], e["checkpoint"]) for e in resumes] == [(stop["step"], stop["checkpoint"])]


def test_sigterm_to_the_group_checkpoints_and_exits_143_without_a_traceback(tmp_path):
    code, err = run_alone_and_signal(tmp_path, signal.SIGTERM)
    assert "Traceback" not in err and "DataLoader worker" not in err, err
    assert code == 128 + signal.SIGTERM
    assert the_stop(tmp_path)["signal"] == "SIGTERM"


def launch(work: Path, endpoint: str, **agent_env: str) -> Agent:
    """One agent with two workers, each with two loader workers, in a process group of its own."""
    args = [arg.replace("--data.num_workers=0", "--data.num_workers=2") for arg in trainer_args(work, 100000, 5)]
    return Agent("agent", endpoint, "stop", work, args, min_nodes=1, max_nodes=1, nproc_per_node=2,
                 grace_period_s=600, env={"PYTHONPATH": str(REPO), **agent_env})


def run_under_the_launcher(work: Path, signum: int) -> tuple[int, str]:
    with LocalEtcd() as endpoint:
        agent = launch(work, endpoint)
        try:
            wait_until(lambda: trained(work), "a trained step", 120, [agent])
            os.killpg(agent.proc.pid, signum)
            code = agent.wait(timeout=120)
        finally:
            agent.stop()
        wait_until(lambda: group_gone(agent.proc.pid), "the workers to exit", 30, [agent])
        return code, agent.output()


def test_sigterm_to_the_launchers_group_checkpoints_without_a_traceback(tmp_path):
    code, output = run_under_the_launcher(tmp_path, signal.SIGTERM)
    assert code == EXIT_STOPPED
    assert "Traceback" not in output, output[-5000:]
    assert the_stop(tmp_path)["signal"] == "SIGTERM"


def test_ctrl_c_to_the_launchers_group_says_so_once_and_checkpoints(tmp_path):
    # The agent forwards the Ctrl-C it got to its workers, which had it from the terminal already:
    # that copy is not a second Ctrl-C (which would exit without a checkpoint).
    code, output = run_under_the_launcher(tmp_path, signal.SIGINT)
    assert code == 128 + signal.SIGINT
    assert output.count(CTRL_C) == 1 and "second Ctrl-C" not in output, output[-5000:]
    assert "Traceback" not in output, output[-5000:]
    assert the_stop(tmp_path)["signal"] == "SIGINT"


def test_a_second_ctrl_c_under_the_launcher_exits_at_once(tmp_path):
    # The first Ctrl-C's checkpoint takes long (the fault injection of training.loop.checkpoint);
    # torch's agent would take the second one for a new shutdown with the whole budget (585 s here).
    with LocalEtcd() as endpoint:
        agent = launch(tmp_path, endpoint, **{SLOW_WRITE_ENV: "600"})
        try:
            wait_until(lambda: trained(tmp_path), "a trained step", 120, [agent])
            os.killpg(agent.proc.pid, signal.SIGINT)
            wait_until(lambda: any(e["event"] == "checkpoint_started" for e in read_events(tmp_path / "metrics.jsonl")),
                       "the stop checkpoint to start", 60, [agent])
            # torch's agent logs this as it starts shutting its workers down (forwarding the signal).
            wait_until(lambda: "Received 2 death signal" in agent.output(), "the agent's shutdown", 60, [agent])
            os.killpg(agent.proc.pid, signal.SIGINT)
            code = agent.wait(timeout=60)
        finally:
            agent.stop()
        wait_until(lambda: group_gone(agent.proc.pid), "the workers to exit", 30, [agent])
    assert code == 128 + signal.SIGINT
    assert agent.output().count("second Ctrl-C: exiting now, without a checkpoint") == 1
