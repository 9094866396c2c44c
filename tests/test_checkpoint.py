"""Checkpoints: atomic on a kill mid-write, newest complete wins, last K kept, async writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.conftest import REPO
from training.checkpoint import CheckpointManager

pytestmark = pytest.mark.timeout(120)


def test_a_kill_during_a_write_leaves_the_previous_checkpoint_usable(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(10, {"weights": torch.arange(4.0)})
    writer = textwrap.dedent(f"""
        import torch
        from training.checkpoint import CheckpointManager
        CheckpointManager({str(tmp_path)!r}).save(20, {{"weights": torch.ones(96 * 2**20)}})  # 384 MiB
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], cwd=REPO)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".step-000000020.pt.tmp") and p.stat().st_size > 0 for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "the writer finished before it could be killed"
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    assert manager.steps() == [10]  # the half-written file never carries a checkpoint name
    step, state = manager.load_latest()
    assert step == 10 and torch.equal(state["weights"], torch.arange(4.0))
    manager.save(30, {"weights": torch.zeros(1)})  # the next save clears the dead writer's leftovers
    assert not list(tmp_path.glob(".step-*"))


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"step": 1})
    manager.save(2, {"step": 2})
    manager.path(2).write_bytes(manager.path(2).read_bytes()[:20])  # torn by some other tool
    assert manager.load_latest()[0] == 1


def test_only_the_last_k_are_kept(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (5, 10, 15, 20):
        manager.save(step, {"step": step})
    assert manager.steps() == [15, 20]


def test_async_save_copies_first_so_later_changes_do_not_leak_in(tmp_path):
    manager = CheckpointManager(tmp_path, async_save=True)
    weights = torch.zeros(1000)
    manager.save(1, {"weights": weights})
    weights += 1  # training goes on while the file is written
    manager.wait()
    assert torch.equal(manager.load_latest()[1]["weights"], torch.zeros(1000))


def test_an_async_write_error_surfaces_in_the_training_loop(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    manager = CheckpointManager(tmp_path / "file" / "checkpoints", async_save=True)
    manager.save(1, {"x": 1})
    with pytest.raises(OSError):
        manager.wait()


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert CheckpointManager(tmp_path / "none").load_latest() is None
