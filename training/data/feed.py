"""From the loader to the device: batches moved without blocking, one ahead of the step that trains on them."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from training.data.batch_slots import BatchSlots
from training.device import Runtime


def move(batch: Any, runtime: Runtime, channels_last: bool) -> Any:
    """Move a batch to the device without blocking. Image batches: uint8 NHWC (decoded images) are
    normalized on the device; 4-D batches optionally as channels_last."""
    if isinstance(batch, torch.Tensor):
        batch = batch.to(runtime.device, non_blocking=True)
        if batch.dim() == 4 and batch.dtype == torch.uint8:
            from training.data.transforms import normalize_on_device

            batch = normalize_on_device(batch)  # channels_last already: NHWC permuted
            return batch if channels_last else batch.contiguous()
        if channels_last and batch.dim() == 4:
            batch = batch.contiguous(memory_format=torch.channels_last)
        return batch
    if isinstance(batch, (list, tuple)):
        return type(batch)(move(b, runtime, channels_last) for b in batch)
    return batch


@dataclass
class DeviceBatch:
    """One micro-batch on the device; ``index`` and ``problems`` stay on the host for the logs."""

    inputs: Any
    target: Any
    weight: torch.Tensor
    index: torch.Tensor
    host_weight: torch.Tensor
    problems: list[str]
    attention_mask: torch.Tensor | None = None


class DeviceFeed:
    """Micro-batches on the device one ahead of the step that trains on them.

    On CUDA, as soon as the trainer takes a batch (:meth:`take`), a background thread fetches
    the next one from the loader (from its page-locked batch slot, or pinning it), and runs its
    copy, decode (``decoder``, for encoded images) and normalization on a side stream: the
    copies overlap the whole step, and nvJPEG's waits block neither the training thread nor the
    device. The step's stream waits for that batch's event only when it takes the batch.
    Elsewhere :meth:`ahead` prepares the next batch in the training thread, where the trainer
    calls it (after enqueuing a step).
    """

    def __init__(self, batches: Iterable, runtime: Runtime, channels_last: bool, decoder: Any = None,
                 image_size: int = 0, background: bool | None = None, pin: bool = False,
                 slots: BatchSlots | None = None,
                 attention_mask: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None):
        # ``slots``: the loader's batches arrive as views into them, and each slot is handed back
        # once its copy to the device has finished. ``attention_mask``: from a host batch's inputs
        # and targets, the model's attention mask, or None (training.data.datasets.attention_mask).
        self._slots = slots
        self._attention_mask = attention_mask
        self._batches = iter(slots.read(batches) if slots is not None else batches)
        self._runtime, self._channels_last = runtime, channels_last
        self._decoder, self._image_size, self._pin = decoder, image_size, pin
        self._stream = torch.cuda.Stream(runtime.device) if runtime.kind == "cuda" else None
        background = runtime.kind == "cuda" if background is None else background
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="device-feed") if background else None
        self._next: Future | tuple[DeviceBatch | None, Any] | None = None
        self.data_wait_s = 0.0  # seconds the training thread waited for input; the trainer reads and resets it

    def ahead(self) -> None:
        """Start preparing the next batch, unless one is already on its way."""
        if self._next is not None:
            return
        if self._pool is not None:
            self._next = self._pool.submit(self._fetch)
            return
        started = time.perf_counter()
        self._next = self._fetch()
        self.data_wait_s += time.perf_counter() - started

    def take(self) -> DeviceBatch:
        """The next batch, ready for the current stream; StopIteration when the loader is done."""
        self.ahead()
        pending, self._next = self._next, None
        if isinstance(pending, Future):
            started = time.perf_counter()
            pending = pending.result()
            self.data_wait_s += time.perf_counter() - started
        batch, ready = pending
        if batch is None:
            raise StopIteration
        if self._pool is not None:
            # Fetch the next batch at once, so that it overlaps this whole step. (Measured on an H100
            # with ResNet-50: fetched after the step's launches instead, the feed thread fell behind.)
            self.ahead()
        if ready is not None:
            current = torch.cuda.current_stream(self._runtime.device)
            current.wait_event(ready)
            for tensor in (batch.inputs, batch.target, batch.weight, batch.attention_mask):
                if isinstance(tensor, torch.Tensor):
                    # Made on the side stream, freed only once the step's stream is done with them.
                    tensor.record_stream(current)
        return batch

    def close(self) -> None:
        """Let a fetch in flight finish (the loader must not be torn down under it)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._next = None
        if self._slots is not None:
            self._slots.settle()

    def _fetch(self) -> tuple[DeviceBatch | None, Any]:
        try:
            raw = next(self._batches)
        except StopIteration:
            return None, None
        if self._stream is None:
            batch, ready = self._prepare(*raw), None
        else:
            with torch.cuda.device(self._runtime.device), torch.cuda.stream(self._stream):
                batch = self._prepare(*raw)
                ready = torch.cuda.Event()
                ready.record(self._stream)
        if self._slots is not None:
            self._slots.copied(ready)
        return batch, ready

    def _prepare(self, inputs: Any, target: Any, index: torch.Tensor, weight: torch.Tensor,
                 problems: Any) -> DeviceBatch:
        problems = list(problems)
        if self._pin:  # pinned here, on the feed thread, rather than by the DataLoader's own thread
            inputs, target, weight = inputs.pin_memory(), target.pin_memory(), weight.pin_memory()
        if self._decoder is not None and not isinstance(inputs, torch.Tensor):
            inputs, failed = self._decoder(inputs, self._image_size, self._runtime.device)
            for position, reason in failed.items():  # unreadable after all: padding, named and counted
                if weight[position] > 0:
                    problems[position] = reason
                weight[position] = 0.0
        mask = self._attention_mask(inputs, target) if self._attention_mask is not None else None
        if mask is not None and self._stream is not None:
            mask = mask.pin_memory()  # so that its copy, too, leaves the host at once
        moved, target, moved_weight, mask = move((inputs, target, weight, mask), self._runtime, self._channels_last)
        return DeviceBatch(moved, target, moved_weight, index, weight, problems, mask)
