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
problems. The DataLoader keeps at most ``workers * prefetch_factor`` batches requested ahead
(torch.utils.data.dataloader, ``_try_put_index``), so with two more slots than that a slot is
refilled only two batches after it was read, once its copy to the device has finished
(:meth:`BatchSlots.read` waits for that copy's event).
"""

from __future__ import annotations

import logging
import threading
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


@dataclass(frozen=True)
class SlotRequest:
    """One micro-batch's sample keys and the slot its worker writes them into."""

    slot: int
    keys: list[Any]


@dataclass(frozen=True)
class FilledSlot:
    """A worker's answer: the batch is in ``slot``; ``problems`` names the samples that could not be read."""

    slot: int
    size: int
    problems: list[str]


class SlotSampler(Sampler):
    """The batch sampler's micro-batches, each with its slot: batch n goes to slot n mod ``count``."""

    def __init__(self, batches: Sampler, count: int):
        self.batches, self.count = batches, count

    def __iter__(self) -> Iterator[SlotRequest]:
        for n, keys in enumerate(self.batches):
            yield SlotRequest(n % self.count, list(keys))

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
            self.slots.write(request.slot, position, inputs, target, index, weight)
            problems.append(problem)
        return FilledSlot(request.slot, len(request.keys), problems)


class BatchSlots:
    """``count`` batches of ``batch_size`` samples shaped like ``sample`` (inputs, target), in shared memory.

    ``pin_for``: a CUDA device; the memory is registered as page-locked, so that copies to the
    device are asynchronous DMA from the slots themselves.
    """

    def __init__(self, count: int, batch_size: int, sample: tuple[Any, Any], pin_for: torch.device | None = None):
        inputs, target = (torch.as_tensor(part) for part in sample)
        self.count, self.batch_size = count, batch_size
        self.inputs = torch.empty((count, batch_size, *inputs.shape), dtype=inputs.dtype).share_memory_()
        self.target = torch.empty((count, batch_size, *target.shape), dtype=target.dtype).share_memory_()
        # Index and weight as the default collation makes them from ints and floats.
        self.index = torch.empty((count, batch_size), dtype=torch.int64).share_memory_()
        self.weight = torch.empty((count, batch_size), dtype=torch.float64).share_memory_()
        self._registered: list[Tensor] = []
        self._device = pin_for
        if pin_for is not None:
            self._register()
        self._copies: deque = deque()

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
        return SlotSampler(batches, self.count)

    def read(self, filled: Iterable[FilledSlot]) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor, list[str]]]:
        """The loader's batches as views into their slots, in the trainer's (inputs, target, index,
        weight, problems) form. Before asking the loader for a batch (which lets it request one
        more, into the slot read two batches ago), waits until that slot's copy has finished."""
        batches = iter(filled)
        while True:
            if len(self._copies) == 2:
                done = self._copies.popleft()
                if done is not None:
                    done.synchronize()
            try:
                batch = next(batches)
            except StopIteration:
                return
            n, s = batch.size, batch.slot
            # Index and weight are small and stay on the host for the logs: copies, not views.
            yield (self.inputs[s, :n], self.target[s, :n], self.index[s, :n].clone(), self.weight[s, :n].clone(),
                   batch.problems)

    def copied(self, event: Any) -> None:
        """The batch last read has been copied out, once ``event`` completes (None: already done)."""
        self._copies.append(event)

    def settle(self) -> None:
        """Wait for every copy out of the slots (before a new loader refills them)."""
        while self._copies:
            done = self._copies.popleft()
            if done is not None:
                done.synchronize()

    def close(self) -> None:
        self.settle()
        if self._registered:
            thread = threading.Thread(target=self._unregister_all, name="batch-slots-unregister")
            thread.start()
            thread.join()


def slot_count(workers: int, prefetch_factor: int) -> int:
    """Slots enough that the loader never refills one whose copy may still be running."""
    return workers * prefetch_factor + 2
