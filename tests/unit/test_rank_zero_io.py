"""Rank 0's checkpoint I/O with the other ranks waiting in the store, not in a collective
(training/loop/rank_zero_io.py). Two ranks as threads sharing one real store (c10d's HashStore);
the trainer's own runs with two gloo processes are in tests/drills/test_slow_checkpoint_io.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from training.loop import rank_zero_io
from training.loop.rank_zero_io import RankZeroIO, RankZeroIOError, deadline_s, tensor_bytes

# Timed (a deadline: two threads meet at a 30 s barrier around rank 0's I/O): make test runs it with the timed
# drills, not at the lowest priority beside them (tests/background.py), where a timed drill keeping both cores busy
# would make it late.
pytestmark = pytest.mark.timed


def _ranks(store, min_throughput_mb_s: float = 50.0, prefix: str = "round") -> list[RankZeroIO]:
    barrier = threading.Barrier(2, timeout=30)
    return [RankZeroIO(rank, store, prefix, min_throughput_mb_s, barrier=barrier.wait) for rank in range(2)]


def _both(first, second) -> dict:
    """Run ``first`` (rank 0) and ``second`` (rank 1) at once; what each returned or raised."""
    outcome: dict = {}

    def call(rank, fn):
        try:
            outcome[rank] = fn()
        except Exception as exc:  # noqa: BLE001 - the test looks at what each rank raised
            outcome[rank] = exc

    threads = [threading.Thread(target=call, args=(rank, fn)) for rank, fn in enumerate((first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outcome


def test_the_others_go_on_only_once_rank_zero_is_done():
    zero, one = _ranks(dist.HashStore())
    events = []

    def read():
        time.sleep(0.2)  # a file system slower than the other rank's first look
        events.append("rank 0 read")
        return {"kind": "resume"}

    def follow():
        result = one.run("read the checkpoint to resume", lambda: 0, lambda: pytest.fail("rank 1 read"))
        events.append("rank 1 went on")
        return result

    outcome = _both(lambda: zero.run("read the checkpoint to resume", lambda: 10, read), follow)
    assert outcome == {0: {"kind": "resume"}, 1: None}
    assert events == ["rank 0 read", "rank 1 went on"]


def test_rank_zeros_failure_fails_the_others_at_once():
    zero, one = _ranks(dist.HashStore())

    def write():
        raise OSError("No space left on device")

    outcome = _both(lambda: zero.run("write the checkpoint", lambda: 10, write),
                    lambda: one.run("write the checkpoint", lambda: 10, write))
    assert isinstance(outcome[0], OSError)
    assert isinstance(outcome[1], RankZeroIOError) and "rank 0 failed to write the checkpoint" in str(outcome[1])


def test_the_others_give_up_after_a_deadline_that_follows_the_bytes(monkeypatch):
    assert deadline_s(int(3.75 * 2**30), 50) == pytest.approx(rank_zero_io.MARGIN_S + 80.5, abs=0.1)
    monkeypatch.setattr(rank_zero_io, "MARGIN_S", 0.05)
    store = dist.HashStore()
    store.set("earlier-round/1/end", "done")  # another round's key answers nobody here
    store.set("round/1/bytes", "1000")  # rank 0 began moving 1000 bytes, at 0.01 MB/s: 0.1 s allowed
    with pytest.raises(RankZeroIOError, match=r"^checkpoint\.min_throughput_mb_s: rank 0 took more than .*allowed"):
        _ranks(store, min_throughput_mb_s=0.01)[1].run("write the checkpoint", lambda: 0, lambda: None)


def test_without_a_process_group_rank_zero_just_works():
    assert not dist.is_initialized()
    assert RankZeroIO.for_group("round", 50).run("write the checkpoint", lambda: 0, lambda: "written") == "written"


def test_a_state_dicts_bytes():
    state = {"model": {"w": torch.zeros(4, 2)}, "optimizer": {"state": {0: {"m": torch.zeros(3, dtype=torch.float64)}},
                                                               "param_groups": [{"lr": 0.1}]}}
    assert tensor_bytes(state, [torch.zeros(1, dtype=torch.int8)]) == 4 * 2 * 4 + 3 * 8 + 1


def test_a_synchronous_save_announces_the_write_still_in_flight_too(tmp_path, monkeypatch):
    # A stop during an asynchronous write: rank 0 first finishes that write (CheckpointManager.save
    # waits for it), then writes its own; the others' deadline must cover both.
    from tests.drills.test_trainer_metrics import small_run
    from training.loop.checkpoint import CheckpointManager
    from training.loop.trainer import Trainer

    trainer = Trainer(small_run(tmp_path, "--train.max_steps=2"))
    one = trainer._state_bytes()
    assert trainer._bytes_to_write() == one
    monkeypatch.setattr(CheckpointManager, "in_flight", property(lambda self: True))
    assert trainer._bytes_to_write() == 2 * one
