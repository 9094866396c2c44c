"""Checkpoints: atomic on a kill mid-write, announced only when durable, staged outside the
exported tree under unique names, loaded without running code, and checked at startup."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from tests.conftest import REPO
from training.loop.checkpoint import STALE_TEMPORARY_S, CheckpointError, CheckpointManager, HostCopies, _unique

# Timed (a deadline: a wait(timeout=0.2) must return within 1 s, and a writer is killed within 60 s of its start):
# make test runs it with the timed drills, not at the lowest priority beside them (tests/background.py), where a
# timed drill keeping both cores busy would make it late.
pytestmark = [pytest.mark.timed, pytest.mark.timeout(120)]


def test_a_kill_during_a_write_leaves_the_previous_checkpoint_usable(tmp_path):
    directory, staging = tmp_path / "checkpoints", tmp_path / "staging"
    manager = CheckpointManager(directory, keep_last=3, staging_dir=staging)
    manager.save(10, {"weights": torch.arange(4.0)})
    writer = textwrap.dedent(f"""
        import torch
        from training.loop.checkpoint import CheckpointManager
        CheckpointManager({str(directory)!r}, staging_dir={str(staging)!r}).save(
            20, {{"weights": torch.ones(96 * 2**20)}})  # 384 MiB
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], cwd=REPO)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith("step-000000020.pt.") and p.stat().st_size > 0 for p in staging.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "the writer finished before it could be killed"
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    assert manager.steps() == [10]  # the half-written file never carries a checkpoint name
    assert sorted(p.name for p in directory.iterdir()) == ["step-000000010.pt"]  # nothing half-written is exported
    newest = manager.load_newest()
    assert newest.step == 10 and torch.equal(newest.state["weights"], torch.arange(4.0))

    # The dead writer's leftover is kept while it could still be a live writer's, removed once stale.
    (leftover,) = staging.iterdir()
    manager.save(30, {"weights": torch.zeros(1)})
    assert leftover.exists()
    old = time.time() - STALE_TEMPORARY_S - 60
    os.utime(leftover, (old, old))
    manager.save(40, {"weights": torch.zeros(1)})
    assert not leftover.exists()


def test_temporary_names_are_unique_even_for_the_same_pid(tmp_path):
    # Pods on a shared file system have their own pid namespaces: pid 1 writes in every one of them.
    assert _unique() != _unique()
    assert f".{os.getpid()}." in _unique()


def test_a_checkpoint_is_announced_only_once_it_is_on_disk(tmp_path):
    announced = []

    def on_saved(saved):
        assert saved.path.exists() and saved.path.stat().st_size == saved.bytes  # renamed into place already
        assert CheckpointManager(tmp_path).load_newest().step == saved.step  # and readable by anyone
        announced.append(saved.step)

    manager = CheckpointManager(tmp_path, async_save=True, on_saved=on_saved)
    manager.save(5, {"weights": torch.ones(2**20)})
    manager.wait()
    assert announced == [5] and manager.last_saved.write_s > 0


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_one_and_says_so(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"step": 1})
    manager.save(2, {"step": 2})
    manager.path(2).write_bytes(manager.path(2).read_bytes()[:20])  # torn by some other tool
    newest = manager.load_newest()
    assert newest.step == 1 and newest.unreadable and newest.unreadable[0].startswith("step-000000002.pt: ")
    manager.path(1).write_bytes(b"\0" * 64)  # overwritten by some other tool
    assert manager.load_newest().unreadable[-1] == (
        "step-000000001.pt: not a checkpoint file (torn, truncated or overwritten)")


class _Planted:
    """What someone with write access to the shared file system could leave there."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_loading_never_runs_code_from_the_file(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(1, {"step": 1})
    marker = tmp_path / "code-ran"
    torch.save({"model": _Planted(str(marker))}, manager.path(2))
    newest = manager.load_newest()
    assert not marker.exists()
    assert newest.step == 1 and newest.unreadable[0].startswith(
        "step-000000002.pt: refused: it holds code, not only tensors and plain values (Unsupported global: GLOBAL io.open")


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
    assert torch.equal(manager.load_newest().state["weights"], torch.zeros(1000))


def test_an_async_write_error_surfaces_in_the_training_loop(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    manager = CheckpointManager(tmp_path / "file" / "checkpoints", async_save=True)
    manager.save(1, {"x": 1})
    with pytest.raises(OSError):
        manager.wait()


def test_waiting_for_a_write_can_be_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINING_FAULT_SLOW_CHECKPOINT_WRITE_S", "2")
    manager = CheckpointManager(tmp_path, async_save=True)
    manager.save(1, {"x": torch.ones(10)})
    started = time.monotonic()
    assert manager.wait(timeout=0.2) is False and time.monotonic() - started < 1
    assert manager.in_flight
    assert manager.wait() is True and manager.steps() == [1]


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    newest = CheckpointManager(tmp_path / "none").load_newest()
    assert newest.state is None and newest.unreadable == []


def test_the_probe_finds_an_unusable_directory_before_any_training(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"^checkpoint\.dir: cannot create .*file/checkpoints \(Not a directory\)"):
        CheckpointManager(tmp_path / "file" / "checkpoints").probe()
    # A staging directory on another file system: every rename into place would fail (EXDEV).
    other = "/dev/shm" if os.stat("/dev/shm").st_dev != os.stat(tmp_path).st_dev else None
    if other is None:
        pytest.skip("no second file system here")
    staging = f"{other}/staging-{os.getpid()}"
    with pytest.raises(CheckpointError, match=r"^checkpoint\.staging_dir: cannot move a file .* same file system"):
        CheckpointManager(tmp_path / "checkpoints", staging_dir=staging).probe()
    os.rmdir(staging)
    CheckpointManager(tmp_path / "checkpoints", staging_dir=tmp_path / "staging").probe()  # fine: same one
    assert os.listdir(tmp_path / "checkpoints") == [] and os.listdir(tmp_path / "staging") == []


def test_setting_aside_keeps_the_files_but_no_longer_loads_them(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(3, {"step": 3})
    where = manager.set_aside()
    assert manager.steps() == [] and (where / "step-000000003.pt").exists()
    assert where.parent == tmp_path / "set-aside"


@pytest.mark.parametrize("keep_last", [1, 2])
def test_retention_never_removes_the_newest_readable_checkpoint(tmp_path, keep_last):
    """A job resumed past unreadable newer files (torn by a crash, overwritten by some tool): its
    first save must not count them toward keep_last and delete the checkpoint it just wrote."""
    writer = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 5, 6):
        writer.save(step, {"step": step})
    for step in (5, 6):
        writer.path(step).write_bytes(writer.path(step).read_bytes()[:20])
    set_aside = []
    resumed = CheckpointManager(tmp_path, keep_last=keep_last, on_set_aside=lambda *args: set_aside.append(args))
    assert resumed.load_newest().step == 1
    resumed.save(2, {"step": 2})

    assert resumed.steps() == ([2] if keep_last == 1 else [1, 2])
    assert resumed.load_newest().step == 2
    (where, files), = set_aside  # moved, not deleted, and reported
    assert sorted(p.name for p in where.iterdir()) == ["step-000000005.pt", "step-000000006.pt"]
    assert where.parent == tmp_path / "set-aside"
    assert [f.split(":")[0] for f in files] == ["step-000000006.pt", "step-000000005.pt"]


def test_unreadable_files_found_at_a_save_are_set_aside_without_a_resume_first(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, {"step": 1})
    manager.path(2).write_bytes(b"\0" * 64)  # a newer file this manager never read
    manager.path(0).write_bytes(b"\0" * 64)  # an older one: retention would remove it, but it is evidence
    manager.save(3, {"step": 3})
    assert manager.steps() == [3]
    (where,) = (tmp_path / "set-aside").iterdir()
    assert sorted(p.name for p in where.iterdir()) == ["step-000000000.pt", "step-000000002.pt"]


def _failing_reads(monkeypatch, path, failures):
    """torch.load of ``path`` raises EIO ``failures`` times, then reads: a file server that was away."""
    import errno

    load, left = torch.load, {"n": failures}

    def flaky(f, *args, **kwargs):
        if str(f) == str(path) and left["n"]:
            left["n"] -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(f))
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", flaky)
    monkeypatch.setattr("training.loop.checkpoint.READ_RETRY_DELAYS_S", (0.01, 0.01, 0.01))
    return left


def test_a_transient_read_error_is_retried_not_taken_for_a_bad_file(tmp_path, monkeypatch):
    from training.loop.resume import decide

    manager = CheckpointManager(tmp_path / "checkpoints", staging_dir=tmp_path / "staging")
    manager.save(4, {"step": 4, "model": {}})
    left = _failing_reads(monkeypatch, manager.path(4), failures=2)
    decision = decide(manager, {}, {}, "start_fresh")
    assert decision["kind"] == "resume" and decision["step"] == 4 and left["n"] == 0
    assert not (tmp_path / "checkpoints" / "set-aside").exists()


def test_a_read_error_that_persists_does_not_start_fresh_over_the_checkpoints(tmp_path, monkeypatch):
    from training.loop.resume import decide

    manager = CheckpointManager(tmp_path / "checkpoints", staging_dir=tmp_path / "staging")
    manager.save(4, {"step": 4, "model": {}})
    _failing_reads(monkeypatch, manager.path(4), failures=100)
    decision = decide(manager, {}, {}, "start_fresh")
    assert decision["kind"] == "refuse" and manager.steps() == [4]
    assert decision["message"].startswith(
        f"checkpoint.dir: {manager.path(4)} cannot be read (Input/output error) after 4 tries")
    # A file that is really bad still starts fresh as told.
    monkeypatch.undo()
    manager.path(4).write_bytes(b"\0" * 64)
    assert decide(manager, {}, {}, "start_fresh")["kind"] == "fresh"


class _PretendDevice(HostCopies):
    """The tensors in ``on`` stand for device tensors. A copy out of one is queued as a device
    queues it: it takes the tensor's value at that point of the stream (later changes are queued
    after it), and that value lands in the host buffer only once the copy's event is waited for;
    until then the buffer holds NaN, what a reader that did not wait could find there."""

    def __init__(self, on):
        self.pointers = {t.data_ptr() for t in on}
        self.log, self.buffers, self.queued = [], [], []
        self.let_copies_finish = threading.Event()

    def on_device(self, tensor):
        return tensor.data_ptr() in self.pointers

    def empty_like(self, tensor, pin_memory):
        self.log.append(("empty_like", tuple(tensor.shape), pin_memory))
        buffer = torch.full_like(tensor, float("nan"))
        self.buffers.append(buffer)
        return buffer

    def copy_(self, destination, source, non_blocking):
        self.log.append(("copy_", tuple(source.shape), non_blocking, any(destination is b for b in self.buffers)))
        self.queued.append((destination, source.clone()))

    def record(self, device):
        self.log.append(("record", threading.current_thread().name))
        return len(self.queued)

    def synchronize(self, event):
        assert self.let_copies_finish.wait(30)
        self.log.append(("synchronize", threading.current_thread().name))
        for destination, value in self.queued[:event]:
            destination.copy_(value)


def test_device_tensors_are_copied_into_page_locked_buffers_without_blocking_and_read_once_copied(tmp_path):
    weights, moments = torch.arange(6.0).reshape(2, 3), torch.ones(3)
    step = torch.tensor(7)  # a host tensor: cloned at once
    device = _PretendDevice(on=[weights, moments])
    state = {"model": {"w": weights}, "optimizer": {"state": {0: {"exp_avg": moments, "step": step}}},
             "progress": {"step": 3, "history": [["a", 0, 3]]}}
    expected = copy.deepcopy(state)
    manager = CheckpointManager(tmp_path, async_save=True, host_copies=device)

    manager.save(3, state)  # returns with the copies queued, not done: it does not wait for the device
    assert device.log == [("empty_like", (2, 3), True), ("copy_", (2, 3), True, True),
                          ("empty_like", (3,), True), ("copy_", (3,), True, True), ("record", "MainThread")]
    weights += 1  # the next steps change everything at once
    moments.mul_(0)
    step += 1
    device.let_copies_finish.set()
    manager.wait()

    assert device.log[-1] == ("synchronize", "checkpoint-3")  # the writer waited for the copies
    saved = manager.load_newest().state
    assert saved["progress"] == expected["progress"]
    assert torch.equal(saved["model"]["w"], expected["model"]["w"])  # no NaN: read after the copies landed
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"])
    assert torch.equal(saved["optimizer"]["state"][0]["step"], torch.tensor(7))


def test_an_async_save_holds_the_state_at_save_time_while_training_goes_on(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train_step():
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()

    train_step()
    manager = CheckpointManager(tmp_path, async_save=True)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    expected = copy.deepcopy(state)
    manager.save(1, state)
    for _ in range(3):  # at once: weights, running statistics and moments all change in place
        train_step()
    manager.wait()

    saved = manager.load_newest().state
    assert saved["model"].keys() == expected["model"].keys()
    assert all(torch.equal(saved["model"][key], tensor) for key, tensor in expected["model"].items())
    assert all(torch.equal(saved["optimizer"]["state"][index][name], tensor)
               for index, moments in expected["optimizer"]["state"].items() for name, tensor in moments.items())
    changed = model.state_dict()
    assert not torch.equal(changed["0.weight"], expected["model"]["0.weight"])  # training did go on
    assert not torch.equal(changed["1.running_mean"], expected["model"]["1.running_mean"])
