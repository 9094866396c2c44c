"""Flags every rank agrees on: one tiny all-reduce (``any_rank``), or, without a host sync, a step
late (``LaggedAgreement``), with how the flags travel on each kind of device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def any_rank(*flags: bool | torch.Tensor, device: torch.device) -> tuple[bool, ...]:
    """Each flag true on every rank when it is true on any rank: one tiny all-reduce for all of them.

    A flag may be a tensor on ``device`` (a loss that is not finite, say): it is read only
    through the all-reduce, so it adds no host sync of its own. Without a process group the
    flags come back as they are (tensors unread).
    """
    if not dist.is_initialized():
        return flags
    value = _flag_tensor(flags, device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return tuple(bool(v > 0) for v in value.tolist())


def _flag_tensor(flags: tuple[bool | torch.Tensor, ...], device: torch.device) -> torch.Tensor:
    """The flags as one float tensor on ``device``; tensor flags are copied in without a host read."""
    value = torch.tensor([float(f) if isinstance(f, bool) else 0.0 for f in flags], device=device)
    for i, flag in enumerate(flags):
        if isinstance(flag, torch.Tensor):
            value[i] = flag.to(device=device, dtype=value.dtype).reshape(())
    return value


@dataclass
class FlagBuffers:
    """One step's flags on their way: written on the host (``send``), all-reduced in ``reduce`` on
    the device, copied back into ``receive``; ``event`` marks the copy back (None on the host)."""

    send: torch.Tensor
    reduce: torch.Tensor
    receive: torch.Tensor
    event: Any = None


class HostFlags:
    """The flags of a group that reduces in host memory (gloo): one tensor is written, reduced and
    read. Its all-reduce runs on gloo's threads; waiting for it is what ``read_when_ready`` does,
    a step later, once the peers had a step's time to send theirs."""

    def buffers(self, count: int) -> FlagBuffers:
        value = torch.zeros(count)
        return FlagBuffers(send=value, reduce=value, receive=value)

    def to_device(self, buffers: FlagBuffers) -> None:
        """Nothing to copy: ``send`` is ``reduce``."""

    def after_reduce(self, work: Any, buffers: FlagBuffers) -> Any:
        return work

    def read_when_ready(self, work: Any, buffers: FlagBuffers) -> list[float]:
        work.wait()
        return buffers.receive.tolist()


class DeviceFlags:
    """The flags of a group that reduces on a CUDA device (NCCL), without a host synchronization.

    ``torch.tensor(list, device="cuda")`` and ``.tolist()`` of a device tensor both make the host
    wait until the device has run everything queued before them: a copy between host and device
    without ``non_blocking`` ends in ``at::cuda::memcpy_and_sync`` (torch 2.13
    aten/src/ATen/native/cuda/Copy.cu ``copy_kernel_cuda``; torch/csrc/utils/tensor_new.cpp
    builds ``torch.tensor`` on the host, then ``.to(device, non_blocking=false)``; pytorch issue
    120996). Instead the flags go through page-locked host buffers with ``non_blocking`` copies
    (``cudaMemcpyAsync`` in that same function; into pageable memory a copy from the device
    returns only once done: CUDA runtime API, "API synchronization behavior"), the all-reduce's
    work is joined by the current stream only (``Work.wait`` of a CUDA collective blocks the
    stream, not the host: torch docs, distributed, "Synchronous and asynchronous collective
    operations"), and an event recorded after the copy back says when ``receive`` may be read.
    It is read a step later, when the device has normally long passed it: ``query`` says so
    without waiting; only a host that runs more than a step ahead waits on the event
    (``cudaEventSynchronize``), for that step alone.

    ``pin`` and ``event`` let a test stand a CPU in for the device.
    """

    def __init__(self, device: torch.device, pin: bool = True, event: Any = None) -> None:
        self.device = device
        self.pin = pin
        self.event = event or torch.cuda.Event

    def buffers(self, count: int) -> FlagBuffers:
        return FlagBuffers(send=torch.zeros(count, pin_memory=self.pin),
                           reduce=torch.zeros(count, device=self.device),
                           receive=torch.zeros(count, pin_memory=self.pin), event=self.event())

    def to_device(self, buffers: FlagBuffers) -> None:
        buffers.reduce.copy_(buffers.send, non_blocking=True)

    def after_reduce(self, work: Any, buffers: FlagBuffers) -> Any:
        # The current stream waits for the all-reduce; the host goes on (it would wait with
        # TORCH_NCCL_BLOCKING_WAIT=1, which the platform does not set).
        work.wait()
        buffers.receive.copy_(buffers.reduce, non_blocking=True)
        buffers.event.record()
        return buffers.event

    def read_when_ready(self, event: Any, buffers: FlagBuffers) -> list[float]:
        if not event.query():
            event.synchronize()
        return buffers.receive.tolist()


class LazyFlags:
    """The flags of the ``xla`` group, whose all-reduce is an op of the XLA graph on a device tensor
    (torch_xla 2.8.0 torch_xla/distributed/xla_backend.py, ProcessGroupXla.allreduce: ``xm.all_reduce``).
    Nothing runs when it is called: the step's ``mark_step`` runs it with the step's graph, and
    reading ``reduce`` a step later finds it done; read before that, XLA runs it then."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def buffers(self, count: int) -> FlagBuffers:
        value = torch.zeros(count, device=self.device)
        return FlagBuffers(send=torch.zeros(count), reduce=value, receive=value)

    def to_device(self, buffers: FlagBuffers) -> None:
        buffers.reduce.copy_(buffers.send)

    def after_reduce(self, work: Any, buffers: FlagBuffers) -> Any:
        return work

    def read_when_ready(self, work: Any, buffers: FlagBuffers) -> list[float]:
        work.wait()
        return buffers.receive.tolist()


def flag_transport(device: torch.device) -> HostFlags | DeviceFlags | LazyFlags:
    """How the agreement's flags reach a group that reduces on ``device``."""
    if device.type == "cuda":
        return DeviceFlags(device)
    return LazyFlags(device) if device.type == "xla" else HostFlags()


class LaggedAgreement:
    """:func:`any_rank` without the host sync: a step's flags go out as an asynchronous all-reduce,
    and are read at the next step, once that step's work is queued.

    A synchronous agreement makes the host wait each step for the device to finish it, so the
    next step's launches start on an idle GPU. Read a step later, the all-reduce has long
    finished while the device works on the step after; the price is that every rank acts on a
    flag one step after it was raised, all at the same step.

    Two sets of buffers take turns (``transport`` says how the flags travel, see
    :class:`DeviceFlags`): a step's are written again two steps later, after the step between
    has read them, so a copy still queued never reads a buffer the host is rewriting.
    """

    def __init__(self, device: torch.device, transport: HostFlags | DeviceFlags | LazyFlags | None = None) -> None:
        self.device = device
        self.transport = transport or flag_transport(device)
        self._buffers: list[FlagBuffers] = []
        self._turn = 0
        self._in_flight: tuple[Any, FlagBuffers] | None = None

    def exchange(self, *flags: bool | torch.Tensor) -> tuple[bool, ...] | None:
        """Send this step's flags; the previous step's, reduced over every rank (None at the first)."""
        if not self._buffers:
            self._buffers = [self.transport.buffers(len(flags)) for _ in range(2)]
        buffers = self._buffers[self._turn]
        self._turn = 1 - self._turn
        buffers.send.copy_(torch.tensor([float(f) if isinstance(f, bool) else 0.0 for f in flags]))
        self.transport.to_device(buffers)
        for i, flag in enumerate(flags):
            if isinstance(flag, torch.Tensor):  # a device tensor (a loss that is not finite): never read here
                buffers.reduce[i] = flag.to(device=self.device, dtype=buffers.reduce.dtype).reshape(())
        work = dist.all_reduce(buffers.reduce, op=dist.ReduceOp.MAX, async_op=True)
        marker = self.transport.after_reduce(work, buffers)
        previous, self._in_flight = self._in_flight, (marker, buffers)
        if previous is None:
            return None
        return tuple(v > 0 for v in self.transport.read_when_ready(*previous))

    def settle(self) -> None:
        """Complete the all-reduce in flight (before the process group goes away); its flags are dropped."""
        if self._in_flight is not None:
            self.transport.read_when_ready(*self._in_flight)
            self._in_flight = None
