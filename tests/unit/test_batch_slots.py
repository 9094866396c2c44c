"""Batch slots: loader workers write micro-batches into shared (page-locked on CUDA) memory.

The CPU tests run the real DataLoader with worker processes against the plain loader; the CUDA
test (on the GPU image) checks the page locking and the asynchronous copy out of a slot.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from training.data.batch_slots import BatchSlots, FilledSlot, SlotFiller, SlotRequest, slot_count
from training.config import load_train_config
from training.data.datasets import BadSample, build_loader
from training.data.feed import DeviceFeed
from training.device import detect
from training.data.sampler import ElasticBatchPlan, Layout, MicroBatchSampler

# Timed (a deadline: a writer thread waits 0.3 s for the main thread's release): make test runs it with the timed
# drills, not at the lowest priority beside them (tests/background.py), where a timed drill keeping both cores busy
# would make it late.
pytestmark = pytest.mark.timed


class Noisy(torch.utils.data.Dataset):
    """Images and labels from the sample's index; every seventh sample cannot be read."""

    def __len__(self) -> int:
        return 64

    def placeholder(self):
        return torch.zeros(6, 5, 3, dtype=torch.uint8), 0

    def __getitem__(self, key):
        if key.index % 7 == 3:
            raise BadSample(f"sample {key.index}: truncated file")
        generator = torch.Generator().manual_seed(key.index)
        return torch.randint(0, 256, (6, 5, 3), dtype=torch.uint8, generator=generator), key.index % 10


def _loader(workers: int, slots: BatchSlots | None, epoch: int = 0):
    config = load_train_config(None, [f"--data.num_workers={workers}", "--data.prefetch_factor=2"])
    plan = ElasticBatchPlan(len(Noisy()), 4, seed=3)
    sampler = MicroBatchSampler(plan, epoch, 0, 0, Layout(1, 1, 4))
    return build_loader(Noisy(), sampler, config, pin_memory=False, slots=slots)


def _plain(batches):
    return [(x, t, i, w, list(p)) for x, t, i, w, p in batches]


def test_workers_writing_into_slots_give_the_plain_loaders_batches_while_every_slot_is_reused():
    workers = 2
    slots = BatchSlots(slot_count(workers, 2), 4, Noisy().placeholder(), pin_for=None)
    expected = _plain(_loader(workers, None))
    assert len(expected) == 16 > slots.count  # each slot is refilled at least twice
    got = []
    for inputs, target, index, weight, problems in slots.read(_loader(workers, slots)):
        time.sleep(0.01)  # a slow step: the workers run ahead as far as the loader lets them
        got.append((inputs.clone(), target.clone(), index, weight, problems))
        slots.copied(None)
    assert len(got) == len(expected)
    for (x, t, i, w, p), (ex, et, ei, ew, ep) in zip(got, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(t, et) and torch.equal(i, ei) and torch.equal(w, ew)
        assert x.dtype == ex.dtype and t.dtype == et.dtype and w.dtype == ew.dtype
        assert p == ep
    bad = [(int(i), float(w), p) for _, _, index, weight, problems in got
           for i, w, p in zip(index, weight, problems, strict=True) if p]
    assert bad and all(i % 7 == 3 and w == 0.0 and "truncated file" in p for i, w, p in bad)


def test_a_slot_is_released_for_its_next_turn_only_after_its_copy_has_finished():
    slots = BatchSlots(4, 2, (torch.zeros(3), 0), pin_for=None)
    log = []

    class Copy:
        def __init__(self, n):
            self.n = n

        def synchronize(self):
            log.append(f"copy {self.n} done")

    def loader():
        for n in range(5):
            log.append(f"loader asked for {n}; released {slots.released.tolist()}")
            yield FilledSlot(n % 4, n // 4, 2, ["", ""])

    for n, _ in enumerate(slots.read(loader())):
        slots.copied(Copy(n))
    # Before asking for a batch, every copy but the last one's is waited for and its slot released.
    assert log == ["loader asked for 0; released [0, 0, 0, 0]", "loader asked for 1; released [0, 0, 0, 0]",
                   "copy 0 done", "loader asked for 2; released [1, 0, 0, 0]",
                   "copy 1 done", "loader asked for 3; released [1, 1, 0, 0]",
                   "copy 2 done", "loader asked for 4; released [1, 1, 1, 0]", "copy 3 done"]
    slots.settle()
    assert log[-1] == "copy 4 done" and slots.released.tolist() == [2, 1, 1, 1]


class _Keyed:
    """Keyed samples as the loader's dataset gives them: (inputs, target, index, weight, problem)."""

    def __getitem__(self, key):
        return torch.full((3,), float(key)), key, key, 1.0, ""


def test_a_worker_writes_a_slot_only_once_its_previous_turn_is_released_and_says_so_when_it_never_is():
    slots = BatchSlots(2, 2, (torch.zeros(3), 0), pin_for=None, wait_timeout_s=0.3)
    filler = SlotFiller(_Keyed(), slots)
    requests = [SlotRequest(*slots.issue(), [2 * n, 2 * n + 1]) for n in range(3)]
    assert [(r.slot, r.turn) for r in requests] == [(0, 0), (1, 0), (0, 1)]
    assert filler.__getitems__(requests[0]) == FilledSlot(0, 0, 2, ["", ""])  # turn 0: free from the start

    # Turn 1 of slot 0 waits until the consumer has released turn 0 (its copy is done).
    log = []
    writer = threading.Thread(target=lambda: log.append(("written", filler.__getitems__(requests[2]))))
    writer.start()
    writer.join(0.1)
    log.append("turn 0 released")
    assert torch.equal(slots.inputs[0, 0], torch.zeros(3))  # batch 0 is still there
    slots._release(0, 0)
    writer.join(30)
    assert log == ["turn 0 released", ("written", FilledSlot(0, 1, 2, ["", ""]))]
    assert torch.equal(slots.inputs[0, 0], torch.full((3,), 4.0))

    # A turn that is never released: the worker gives up with the slot, the turns and the ring's size.
    stuck = SlotRequest(*slots.issue(), [6, 7])  # slot 1, turn 1; turn 0 of slot 1 was never released
    with pytest.raises(RuntimeError, match=r"^batch slot 1: waited 0.3 s to write its turn 1 while the trainer had "
                                           r"released only up to turn 0 .* the ring holds 2 slots$"):
        filler.__getitems__(stuck)

    # Settling releases every turn handed out, delivered or not: a closed loader's leftovers are
    # refused, and the next loader's batches find their slots free.
    slots.settle()
    assert slots.released.tolist() == [2, 2]
    with pytest.raises(RuntimeError, match="turn 1 belongs to a loader that has been closed"):
        filler.__getitems__(stuck)
    assert filler.__getitems__(SlotRequest(*slots.issue(), [8, 9])) == FilledSlot(0, 2, 2, ["", ""])


def test_a_ring_needs_two_slots():
    with pytest.raises(ValueError, match=r"^batch slots: got count 1; allowed: 2 or more$"):
        BatchSlots(1, 2, (torch.zeros(3), 0))


class _SlowCopy:
    """An asynchronous copy out of a slot, as a DMA engine makes one: it reads the slot over a
    while after it is enqueued, and is done when synchronize() returns. It notes whether the
    slot changed while it was being read: a write into a slot in flight."""

    def __init__(self, views, delay):
        self.source = views  # the batch's inputs and targets: views into its slot
        self.first = [t.clone() for t in self.source]
        self.result = None
        self.thread = threading.Thread(target=self._finish, args=(delay,))
        self.thread.start()

    def _finish(self, delay):
        time.sleep(delay)
        self.result = [t.clone() for t in self.source]

    def synchronize(self):
        self.thread.join()

    @property
    def overwritten(self):
        return not all(torch.equal(a, b) for a, b in zip(self.first, self.result, strict=True))


@pytest.mark.parametrize("count", [2, 3])
def test_no_worker_writes_into_a_slot_whose_copy_is_in_flight_even_with_fewer_slots_than_the_loader_asks_ahead(count):
    # Two workers with prefetch_factor 2 keep 4 batches requested ahead: more than the ring holds.
    # Safety cannot come from how far ahead the DataLoader asks, only from each slot's own copy.
    import random

    workers = 2
    assert count < workers * 2
    slots = BatchSlots(count, 4, Noisy().placeholder(), pin_for=None)
    expected = _plain(_loader(workers, None))
    delays = random.Random(count)
    copies = []
    for inputs, target, index, weight, problems in slots.read(_loader(workers, slots)):
        copy = _SlowCopy((inputs, target), delays.uniform(0, 0.01))
        copies.append((copy, index, weight, problems))
        slots.copied(copy)
    slots.settle()
    assert len(copies) == len(expected) == 16
    assert sum(copy.overwritten for copy, *_ in copies) == 0
    for (copy, i, w, p), (ex, et, ei, ew, ep) in zip(copies, expected, strict=True):
        x, t = copy.result
        assert torch.equal(x, ex) and torch.equal(t, et) and torch.equal(i, ei) and torch.equal(w, ew) and p == ep


def test_the_feed_reads_from_slots_and_hands_each_back_when_the_next_loader_may_refill_it():
    slots = BatchSlots(slot_count(1, 2), 4, Noisy().placeholder(), pin_for=None)
    expected = _plain(_loader(1, None))
    for epoch in range(2):  # a second loader reuses the same slots
        feed = DeviceFeed(_loader(1, slots, epoch), detect("cpu"), channels_last=True, slots=slots)
        reference = expected if epoch == 0 else _plain(_loader(1, None, epoch))
        for _ex, et, ei, _ew, ep in reference:
            batch = feed.take()
            feed.ahead()
            assert torch.equal(batch.target, et) and torch.equal(batch.index, ei) and batch.problems == ep
            assert batch.inputs.shape == (4, 3, 6, 5)  # normalized to NCHW on the way
        with pytest.raises(StopIteration):
            feed.take()
        feed.close()
        assert not slots._copies  # every copy accounted for before the next loader starts


def test_slots_hold_every_batch_the_loader_may_have_asked_for_plus_two():
    assert slot_count(12, 4) == 50 and slot_count(1, 1) == 3


def test_slots_that_cannot_be_page_locked_are_released_and_said_so_off_the_training_thread(monkeypatch, caplog):
    import threading

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, pointer, size, flags):
            calls.append(("register", threading.current_thread().name, flags))
            return 0 if len([c for c in calls if c[0] == "register"]) == 1 else 2  # the second one fails

        def cudaHostUnregister(self, pointer):
            calls.append(("unregister", threading.current_thread().name))
            return 0

        def cudaGetErrorString(self, code):
            return "out of memory"

    monkeypatch.setattr(torch.cuda, "cudart", FakeCudart)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("device", str(device))))
    with caplog.at_level("WARNING"):
        slots = BatchSlots(3, 2, (torch.zeros(3), 0), pin_for=torch.device("cuda", 5))
    assert not slots.pinned
    assert ("device", "cuda:5") in calls  # the rank's device, not device 0
    assert [c[0] for c in calls if c[0] != "device"] == ["register", "register", "unregister"]
    assert all(c[1] == "batch-slots-register" for c in calls if c[0] != "device")
    assert all(c[2] == 1 for c in calls if c[0] == "register")  # cudaHostRegisterPortable
    assert "could not page-lock" in caplog.text and "CUDA error 2: out of memory" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_slots_are_page_locked_and_copied_to_the_device_as_written():
    slots = BatchSlots(slot_count(2, 2), 4, Noisy().placeholder(), pin_for=torch.device("cuda", 0))
    assert slots.pinned and slots.inputs[3].is_pinned()
    runtime = detect("cuda")
    expected = _plain(_loader(2, None))
    feed = DeviceFeed(_loader(2, slots), runtime, channels_last=True, slots=slots)
    reference = DeviceFeed(expected, runtime, channels_last=True, pin=True)
    for _ in expected:
        a, b = feed.take(), reference.take()
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.target, b.target)
        assert a.inputs.device.type == "cuda"
    feed.close()
    reference.close()
    slots.close()
    assert not slots.pinned
