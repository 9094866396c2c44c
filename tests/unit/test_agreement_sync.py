"""The per-step agreement never makes the host wait for the device (issue 35).

On CUDA, ``torch.tensor(list, device="cuda")`` and ``.tolist()`` of a device tensor each wait
for everything queued on the device (torch 2.13 aten/src/ATen/native/cuda/Copy.cu: a copy
between host and device without ``non_blocking`` ends in ``memcpy_and_sync``;
torch/csrc/utils/tensor_new.cpp builds ``torch.tensor`` on the host and copies it with
``non_blocking=false``). Here, without a GPU, a CPU stands in for the device: :class:`FakeDevice`
knows which tensors "live on the device" and records every call that would make the host wait
there; the agreement runs its real CUDA transport (:class:`agreement.DeviceFlags`) through it,
with a real (one-rank gloo) all-reduce. Where CUDA exists, the same steps run on the GPU under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from training.loop import agreement
from training.loop.agreement import LaggedAgreement

STEPS = 6
# Reads that copy a device tensor to the host and wait for it (tensor_list.cpp / Copy.cu).
READS = {"tolist", "item", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"}


class Clock:
    """The step the agreement is exchanging; a fake event completes once a later step began (the
    steady state the agreement counts on: the device finished step n while step n + 1 queued)."""

    step = 0


class FakeEvent:
    def __init__(self, clock: Clock, device: "FakeDevice") -> None:
        self.clock, self.device, self.recorded_at = clock, device, None

    def record(self, stream=None) -> None:
        self.recorded_at = self.clock.step

    def query(self) -> bool:
        return self.recorded_at is not None and self.recorded_at < self.clock.step

    def synchronize(self) -> None:
        if not self.query():
            self.device.blocking.append(f"Event.synchronize of step {self.recorded_at}'s event during that step")


class FakeDevice(TorchFunctionMode):
    """A CPU that stands for an accelerator: tensors marked as on the device (made by a factory
    with ``device=``, or computed from such tensors) and pinned host tensors; every call that
    would wait for a real device is recorded in ``blocking``. (``.to("cpu")`` is not told from
    ``.to(device)`` here, where both name the CPU; ``.cpu()`` and the reads are.)"""

    def __init__(self) -> None:
        super().__init__()
        self.blocking: list[str] = []

    @staticmethod
    def on_device(value) -> bool:
        return isinstance(value, torch.Tensor) and getattr(value, "_fake_on_device", False)

    @staticmethod
    def pinned(value) -> bool:
        return isinstance(value, torch.Tensor) and getattr(value, "_fake_pinned", False)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            self.blocking.append(f"torch.{name}(data, device=...): built on the host, copied with non_blocking=False")
        elif name in READS and args and self.on_device(args[0]):
            self.blocking.append(f"Tensor.{name}() of device memory")
        elif name == "copy_":
            destination, source = args[0], args[1]
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if self.on_device(destination) != self.on_device(source):
                host = source if self.on_device(destination) else destination
                if not (non_blocking and self.pinned(host)):
                    self.blocking.append(f"copy_ between host and device (non_blocking={non_blocking}, "
                                         f"host pinned={self.pinned(host)})")
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and name != "copy_" and (
                kwargs.get("device") is not None
                or any(self.on_device(a) for a in (*args, *kwargs.values()))):
            result._fake_on_device = True
        return result


class FakeDeviceFlags(agreement.DeviceFlags):
    """The real CUDA transport, its buffers marked for :class:`FakeDevice`, pinned ones included."""

    def __init__(self, clock: Clock, device: FakeDevice) -> None:
        super().__init__(torch.device("cpu"), pin=False, event=lambda: FakeEvent(clock, device))

    def buffers(self, count: int) -> agreement.FlagBuffers:
        buffers = super().buffers(count)
        buffers.send._fake_pinned = buffers.receive._fake_pinned = True
        buffers.reduce._fake_on_device = True
        return buffers


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _flags(step: int, nonfinite: torch.Tensor) -> tuple:
    """The trainer's five: stop, spot notice, save next, loss not finite (a device tensor), regroup."""
    return step == 1, False, step == 3, nonfinite, False


# Step n's flags come back at step n + 1.
EXPECTED = [None, (False,) * 5, (True, False, False, False, False), (False,) * 5,
            (False, False, True, False, False), (False, False, False, True, False)]


def test_the_steady_state_agreement_makes_no_blocking_call(one_rank_group):
    clock, device = Clock(), FakeDevice()
    lagged = LaggedAgreement(torch.device("cpu"), transport=FakeDeviceFlags(clock, device))
    seen = []
    for step in range(STEPS):
        clock.step = step
        loss = torch.tensor(float("nan") if step == 4 else 1.0)  # the step's loss, on the device
        loss._fake_on_device = True
        with device:
            seen.append(lagged.exchange(*_flags(step, ~torch.isfinite(loss))))
    assert device.blocking == []
    assert seen == EXPECTED  # each step's flags, a step later, the loss's finiteness included
    lagged.settle()


def test_the_recorder_flags_what_the_agreement_did_before():
    """The pattern the agreement used until issue 35 (a tensor built with ``device=``, read back
    with ``.tolist()``) is what :class:`FakeDevice` catches: the test above can fail."""
    device = FakeDevice()
    with device:
        value = torch.tensor([0.0, 1.0], device="cpu")
        value.tolist()
    assert len(device.blocking) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_steady_state_agreement_does_not_synchronize():
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        lagged = LaggedAgreement(device)
        assert isinstance(lagged.transport, agreement.DeviceFlags)
        weights = torch.randn(512, 512, device=device)
        seen = []
        for step in range(STEPS):
            loss = (weights @ weights).mean() * (float("nan") if step == 4 else 1.0)
            # The previous step's copy back is done, as it is when the device keeps up: any
            # synchronization left inside the agreement is its own.
            torch.cuda.synchronize()
            if step:
                torch.cuda.set_sync_debug_mode("error")
            try:
                seen.append(lagged.exchange(*_flags(step, ~torch.isfinite(loss))))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        lagged.settle()
        assert seen == EXPECTED
    finally:
        dist.destroy_process_group()
