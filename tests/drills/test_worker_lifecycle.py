"""Workers and their agent: no orphan trains alone, and the restart budget is spent only by crash
loops, not by the interruptions a long job on Spot capacity lives through. Real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from training.contract import EXIT_CRASH_LOOP
from trainctl.backends.local_cluster import Agent, read_events, wait_until

pytestmark = pytest.mark.timeout(300)

# An "agent" that starts its worker the way torchrun does (a new session) and dies at once,
# while the worker is still importing torch.
DYING_AGENT = textwrap.dedent("""
    import os, subprocess, sys
    os.environ["PLATFORM_AGENT_PID"] = str(os.getpid())
    os.environ["TORCHELASTIC_RUN_ID"] = "orphan-test"
    worker = subprocess.Popen([sys.executable, "-m", "training", "train", *sys.argv[2:]], start_new_session=True)
    with open(sys.argv[1], "w") as handle:
        handle.write(str(worker.pid))
    os._exit(0)
""")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie waiting to be reaped has stopped


def test_a_worker_whose_agent_dies_during_startup_never_trains(tmp_path):
    pid_file = tmp_path / "worker.pid"
    args = ["--model.name=mlp", "--model.image_size=16", "--train.max_steps=200", "--train.device=cpu",
            "--train.precision=fp32", "--data.num_workers=0", f"--checkpoint.dir={tmp_path}/checkpoints",
            f"--metrics.jsonl_path={tmp_path}/metrics.jsonl"]
    subprocess.run([sys.executable, "-c", DYING_AGENT, str(pid_file), *args], cwd=REPO, check=True, timeout=60)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the orphaned worker is still running"
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()


BUDGET_STEPS = 1_000


def budget_args(work: Path, interval: int) -> list[str]:
    """1,000 steps: the three crashes of the budget drill are over by about step 350 (3,000 steps and a final
    evaluation asserted nothing more and cost 9 s)."""
    return [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=4", "--data.synthetic_samples=400000",
        "--data.num_workers=0", "--train.global_batch_size=16", "--train.micro_batch_size=16", "--train.epochs=1",
        f"--train.max_steps={BUDGET_STEPS}", "--train.precision=fp32", "--train.log_every_steps=10",
        "--eval.enabled=false",
        f"--checkpoint.dir={work}/checkpoints", f"--checkpoint.interval_steps={interval}",
        f"--metrics.jsonl_path={work}/metrics.jsonl",
    ]


def events(work: Path, kind: str) -> list[dict]:
    return [e for e in read_events(work / "metrics.jsonl") if e["event"] == kind]


def test_crashes_after_progress_do_not_spend_the_restart_budget(tmp_path, etcd_module):
    agent = Agent("solo", etcd_module, "budget-progress", tmp_path, budget_args(tmp_path, 100), max_nodes=1,
                  max_restarts=1)
    try:
        wait_until(lambda: events(tmp_path, "rendezvous"), "the first round", 120, [agent])
        for crash in range(3):  # three times the budget
            seen = len(events(tmp_path, "rendezvous"))
            wait_until(lambda: [e for e in events(tmp_path, "checkpoint_saved")
                                if e["time"] > events(tmp_path, "rendezvous")[-1]["time"]],
                       f"a checkpoint in round {crash + 1}", 120, [agent])
            agent.kill_workers()
            wait_until(lambda seen=seen: len(events(tmp_path, "rendezvous")) > seen, "the restart", 120, [agent])
        assert agent.wait(timeout=240) == 0, agent.output()[-3000:]
    finally:
        agent.stop()
    assert agent.output().count("this restart does not count against --max-restarts") == 3
    assert events(tmp_path, "finished")[-1]["step"] == BUDGET_STEPS


def test_a_crash_loop_runs_out_of_restarts_and_ends_the_job(tmp_path, etcd_module):
    # No checkpoint since the agent started: a fresh incarnation would fail the same way, so the
    # agent asks the controller to end the job (EXIT_CRASH_LOOP -> TerminateJob), not restart it.
    agent = Agent("solo", etcd_module, "budget-loop", tmp_path, budget_args(tmp_path, 100_000), max_nodes=1,
                  max_restarts=2)
    try:
        assert agent.crash_loop(timeout=120) == EXIT_CRASH_LOOP
    finally:
        agent.stop()
    output = agent.output()
    assert "does not count against --max-restarts" not in output
    assert "--max-restarts is spent with no checkpoint since this agent started" in output
    assert output.count("failed (exitcode: -9)") == 3  # two restarts, then it gave up


def test_a_worker_stuck_waiting_for_a_dead_peer_stops_at_once_on_sigterm(tmp_path):
    """Blocked in init_process_group (C++), Python runs no signal handler: without the wake-up
    pipe the agent would wait its whole stop budget before SIGKILL, at every such restart."""
    import signal
    import socket

    from trainctl.backends.local_cluster import free_port

    port = free_port()
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "stuck", "OMP_NUM_THREADS": "1"}
    worker = subprocess.Popen([sys.executable, "-m", "training", "train", "--model.name=mlp", "--model.image_size=16",
                               "--train.device=cpu", f"--checkpoint.dir={tmp_path}/checkpoints"],
                              cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # rank 0 listens for its peer, which never comes
            assert worker.poll() is None and time.monotonic() < deadline, "the worker did not start"
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        time.sleep(1)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        worker.kill()
    assert "SIGTERM before training started: nothing to checkpoint, exiting now" in worker.stderr.read()
