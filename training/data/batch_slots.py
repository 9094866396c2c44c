"""A ring of host batches in shared, page-locked memory, written by the loader's workers.

Without it, every batch crosses three copies in the trainer's own process: the DataLoader
hands each tensor over as a shared-memory file descriptor (a socket round trip per tensor),
the batch is copied into page-locked memory, and only then to the device. On an H100 that
process is the one launching a compiled ResNet-50's kernels, and its CPU time sets the pace:
profiled, the feed thread's work beside it stretched the launch of the forward from 13.9 to
18.5 ms and of the backward from 20.8 to 22.5 ms a step, and the pinning copy (38 MiB a
batch, on OpenMP threads) alone cost about 3 % (OMP_NUM_THREADS=1 against the default).

Here the workers write each sample straight into its batch's slot: one block of shared
memory per field, allocated once and registered with CUDA as page-locked (cudaHostRegister),
so the device copies from it directly. A worker returns only the slot number and the
problems.

A slot is written again only once the copy out of it has finished, whatever the DataLoader
asks for and when: batch n goes into slot n mod ``count`` as that slot's turn n // ``count``,
and the worker writing it first waits until the slot's previous turn has been released. The
consumer releases a turn once the copy of its batch to the device is known to be done (the
event recorded after that copy was enqueued, see :meth:`BatchSlots.copied`); the released
turns are in shared memory, where the workers read them. The ring's size is for speed only:
the DataLoader keeps ``workers * prefetch_factor`` batches requested ahead
(torch.utils.data.dataloader, ``_try_put_index``, v2.13.0), so with two slots more than that
(:func:`slot_count`) a worker finds its slot already released and never waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

log = logging.getLogger(__name__)

# cudaHostRegisterPortable: page-locked for every CUDA context, not only the registering thread's.
_HOST_REGISTER_PORTABLE = 1
# Seconds a worker waits for its slot before it gives up with an error. With slot_count's ring it
# never waits; with a smaller one it waits for the trainer to take and copy earlier batches,
# which a long evaluation or checkpoint can hold up for minutes.
SLOT_WAIT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class SlotRequest:
    """One micro-batch's sample keys, the slot its worker writes them into and the slot's turn."""

    slot: int
    turn: int
    keys: list[Any]


@dataclass(frozen=True)
class FilledSlot:
    """A worker's answer: the batch is in ``slot`` (its ``turn``); ``problems`` names the samples
    that could not be read."""

    slot: int
    turn: int
    size: int
    problems: list[str]


class SlotSampler(Sampler):
    """The batch sampler's micro-batches, each with its slot and turn (see :meth:`BatchSlots.issue`)."""

    def __init__(self, batches: Sampler, slots: BatchSlots):
        self.batches, self.slots = batches, slots

    def __iter__(self) -> Iterator[SlotRequest]:
        for keys in self.batches:
            slot, turn = self.slots.issue()
            yield SlotRequest(slot, turn, list(keys))

    def __len__(self) -> int:
        return len(self.batches)


class SlotFiller(Dataset):
    """The keyed dataset, read a micro-batch at a time into the slots (in the loader's workers)."""

    def __init__(self, keyed: Dataset, slots: BatchSlots):
        self.keyed, self.slots = keyed, slots

    def __len__(self) -> int:
        return len(self.keyed)

    def __getitem__(self, key: Any) -> Any:
        return self.keyed[key]

    def __getitems__(self, request: SlotRequest) -> FilledSlot:
        problems = []
        for position, key in enumerate(request.keys):
            inputs, target, index, weight, problem = self.keyed[key]
            if position == 0:  # the first sample is read meanwhile
                self.slots.wait_turn(request.slot, request.turn)
            self.slots.write(request.slot, position, inputs, target, index, weight)
            problems.append(problem)
        return FilledSlot(request.slot, request.turn, len(request.keys), problems)


class BatchSlots:
    """``count`` batches of ``batch_size`` samples shaped like ``sample`` (inputs, target), in shared memory.

    ``pin_for``: a CUDA device; the memory is registered as page-locked, so that copies to the
    device are asynchronous DMA from the slots themselves.
    """

    def __init__(self, count: int, batch_size: int, sample: tuple[Any, Any], pin_for: torch.device | None = None,
                 wait_timeout_s: float = SLOT_WAIT_TIMEOUT_S):
        if count < 2:
            # Slot n mod 1 would wait for the release of the batch just before it, which the
            # consumer releases only once it asks for the next one: for this very batch.
            raise ValueError(f"batch slots: got count {count}; allowed: 2 or more")
        inputs, target = (torch.as_tensor(part) for part in sample)
        self.count, self.batch_size = count, batch_size
        self.wait_timeout_s = wait_timeout_s
        self.inputs = torch.empty((count, batch_size, *inputs.shape), dtype=inputs.dtype).share_memory_()
        self.target = torch.empty((count, batch_size, *target.shape), dtype=target.dtype).share_memory_()
        # Index and weight as the default collation makes them from ints and floats.
        self.index = torch.empty((count, batch_size), dtype=torch.int64).share_memory_()
        self.weight = torch.empty((count, batch_size), dtype=torch.float64).share_memory_()
        # Per slot, the turn that may be written now: every earlier turn's batch has been copied
        # out. Written by the consumer, read by the workers (shared memory); one aligned 8-byte
        # value each, so a worker reads either the old turn or the new one.
        self.released = torch.zeros(count, dtype=torch.int64).share_memory_()
        self._issued = 0  # batches handed to loaders so far (in the process that iterates the sampler)
        self._registered: list[Tensor] = []
        self._device = pin_for
        if pin_for is not None:
            self._register()
        self._copies: deque = deque()  # (slot, turn, event) of the batches read, oldest first
        self._last: tuple[int, int] | None = None  # slot and turn of the batch read last

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.inputs, self.target, self.index, self.weight))

    @property
    def pinned(self) -> bool:
        return bool(self._registered)

    def _register(self) -> None:
        # On a thread of its own: a failed CUDA runtime call stays that thread's "last error",
        # which PyTorch's next kernel-launch check would otherwise raise in the training thread.
        failures: list[str] = []
        thread = threading.Thread(target=self._register_all, args=(failures,), name="batch-slots-register")
        thread.start()
        thread.join()
        if failures:
            log.warning("could not page-lock %d MiB of batch slots (%s); each batch is copied to page-locked "
                        "memory first, as without slots", self.nbytes >> 20, failures[0])

    def _register_all(self, failures: list[str]) -> None:
        try:
            torch.cuda.set_device(self._device)  # this rank's device, not device 0 (a context there costs memory)
            cudart = torch.cuda.cudart()
            for tensor in (self.inputs, self.target, self.index, self.weight):
                code = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                               _HOST_REGISTER_PORTABLE)
                if int(code):
                    failures.append(f"CUDA error {int(code)}: {cudart.cudaGetErrorString(code)}")
                    break
                self._registered.append(tensor)
        except (RuntimeError, TypeError, AttributeError) as exc:  # a torch without these bindings
            failures.append(str(exc))
        if failures:
            self._unregister_all()

    def _unregister_all(self) -> None:
        if self._registered:
            torch.cuda.set_device(self._device)
        cudart = torch.cuda.cudart()
        for tensor in self._registered:
            cudart.cudaHostUnregister(tensor.data_ptr())
        self._registered = []

    def write(self, slot: int, position: int, inputs: Any, target: Any, index: int, weight: float) -> None:
        self.inputs[slot, position] = inputs
        self.target[slot, position] = torch.as_tensor(target)
        self.index[slot, position] = index
        self.weight[slot, position] = weight

    def sampler(self, batches: Sampler) -> SlotSampler:
        return SlotSampler(batches, self)

    def issue(self) -> tuple[int, int]:
        """The slot and turn of the next batch a loader asks for: batch n (counted over every loader
        these slots serve) goes into slot n mod ``count``, as its turn n // ``count``."""
        n, self._issued = self._issued, self._issued + 1
        return n % self.count, n // self.count

    def wait_turn(self, slot: int, turn: int) -> None:
        """In a worker, before writing ``turn`` of ``slot``: wait until the copy of the slot's previous
        turn has finished (the consumer released it), whatever the loader has asked for."""
        released = int(self.released[slot])
        if released == turn:
            return
        deadline = time.monotonic() + self.wait_timeout_s
        pause = 0.0005
        while released < turn:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"batch slot {slot}: waited {self.wait_timeout_s:g} s to write its turn {turn} while the "
                    f"trainer had released only up to turn {released} (the copy of an earlier batch out of it "
                    f"has not been seen to finish); the ring holds {self.count} slots")
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
            released = int(self.released[slot])
        if released > turn:
            # Released past this turn: its loader was closed (settle) and nobody will read it.
            raise RuntimeError(f"batch slot {slot}: turn {turn} belongs to a loader that has been closed")

    def _release(self, slot: int, turn: int) -> None:
        self.released[slot] = max(int(self.released[slot]), turn + 1)

    def _settled(self, entry: tuple[int, int, Any]) -> None:
        slot, turn, done = entry
        if done is not None:
            done.synchronize()
        self._release(slot, turn)

    def read(self, filled: Iterable[FilledSlot]) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor, list[str]]]:
        """The loader's batches as views into their slots, in the trainer's (inputs, target, index,
        weight, problems) form. Before asking the loader for a batch, waits for the copies out of
        every slot read before the last one and releases those slots: a worker waiting for one
        is never left waiting on a batch this loop has yet to ask for (see ``count`` >= 2)."""
        batches = iter(filled)
        while True:
            while len(self._copies) >= 2:
                self._settled(self._copies.popleft())
            try:
                batch = next(batches)
            except StopIteration:
                return
            n, s = batch.size, batch.slot
            self._last = (s, batch.turn)
            # Index and weight are small and stay on the host for the logs: copies, not views.
            yield (self.inputs[s, :n], self.target[s, :n], self.index[s, :n].clone(), self.weight[s, :n].clone(),
                   batch.problems)

    def copied(self, event: Any) -> None:
        """The batch last read has been copied out, once ``event`` completes (None: already done):
        its slot is released for the next turn after that."""
        if self._last is None:
            raise RuntimeError("batch slots: copied() with no batch read since the last one")
        slot, turn = self._last
        self._last = None
        self._copies.append((slot, turn, event))

    def settle(self) -> None:
        """Wait for every copy out of the slots and release every turn handed out so far, also those
        of batches a closed loader asked for and never delivered (before a new loader refills them)."""
        while self._copies:
            self._settled(self._copies.popleft())
        self._last = None
        for slot in range(self.count):
            # The turn of the next batch that will go into this slot.
            self._release(slot, (self._issued + self.count - 1 - slot) // self.count - 1)

    def close(self) -> None:
        self.settle()
        if self._registered:
            thread = threading.Thread(target=self._unregister_all, name="batch-slots-unregister")
            thread.start()
            thread.join()


def slot_count(workers: int, prefetch_factor: int) -> int:
    """Slots enough that no worker waits: the loader asks for a batch into a slot only after the
    copy of the slot's previous batch has been released."""
    return workers * prefetch_factor + 2
