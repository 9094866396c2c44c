"""The device layer: one trainer for CUDA GPUs (nccl), Trainium (torch-neuronx, XLA) and CPU (gloo)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

# Dense bf16/fp16 tensor-core peaks per device, for MFU (vendor data sheets, no sparsity).
PEAK_FLOPS = {
    "A100": 312e12,
    "H100": 989e12,
    "H200": 989e12,
    "V100": 125e12,
    "A10G": 125e12,
    "L4": 121e12,
    "NeuronCore-v2": 95e12,  # Trainium: 190 TFLOPS bf16 per chip, two NeuronCores per chip
}


class DeviceError(Exception):
    """The configured device is not on this machine."""


@dataclass
class Runtime:
    """What the training loop needs to know about where it runs."""

    kind: str  # cuda | neuron | cpu
    device: torch.device
    backend: str  # the torch.distributed backend
    name: str
    peak_flops: float | None
    mark_step: Callable[[], None] = field(default=lambda: None)
    capability: tuple[int, int] | None = None  # CUDA compute capability (major, minor)

    def precision(self, requested: str) -> str:
        """``train.precision`` on this device: see :func:`choose_precision`."""
        return choose_precision(requested, self.kind, self.name, self.capability)

    def autocast(self, precision: str) -> contextlib.AbstractContextManager:
        if precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        device_type = "cpu" if self.kind == "cpu" else ("xla" if self.kind == "neuron" else "cuda")
        return torch.autocast(device_type=device_type, dtype=dtype)

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)

    def peak_memory_bytes(self) -> int | None:
        if self.kind == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.kind == "cpu":
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        return None

    def grad_scaler(self, precision: str) -> torch.amp.GradScaler:
        """fp16 needs loss scaling; for bf16 and fp32 the scaler is a disabled pass-through."""
        return torch.amp.GradScaler(self.kind if self.kind != "neuron" else "cpu", enabled=precision == "fp16")


def choose_precision(requested: str, kind: str, name: str, capability: tuple[int, int] | None) -> str:
    """The precision to train in: ``requested`` (train.precision) unless it is ``auto``, which is
    bf16 where the device computes it natively and fp16 (with a GradScaler) elsewhere.

    CUDA GPUs compute bf16 from compute capability 8.0 (Ampere) on; torch's own test for it
    reads the same major version (torch 2.13, torch/cuda/__init__.py, ``is_bf16_supported``:
    ``get_device_properties(device).major >= 8``; below that it answers True when it can merely
    allocate a bf16 tensor, as a V100 can: emulated, without tensor cores). CPUs and Trainium
    take bf16. Asking bf16 of a GPU without it is a mistake, said in one line.
    """
    native_bf16 = kind != "cuda" or (capability is not None and capability >= (8, 0))
    if requested == "auto":
        return "bf16" if native_bf16 else "fp16"
    if requested == "bf16" and not native_bf16:
        where = f"{name} (compute capability {'.'.join(map(str, capability))})" if capability else name
        raise DeviceError(f'train.precision: got "bf16" but {where} has no bf16 tensor cores; allowed here: '
                          "auto (fp16 with loss scaling here), fp16 or fp32")
    return requested


def detect(requested: str = "auto") -> Runtime:
    """The runtime for ``requested`` (auto: CUDA, else Neuron, else CPU) and this process's LOCAL_RANK."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        name = torch.cuda.get_device_name(local_rank)
        peak = next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
        return Runtime("cuda", torch.device("cuda", local_rank), "nccl", name, peak,
                       capability=tuple(torch.cuda.get_device_capability(local_rank)))
    if requested == "cuda":
        raise DeviceError("train.device: got \"cuda\" but torch sees no CUDA device; allowed here: auto, cpu")
    if requested in ("auto", "neuron"):
        neuron = _neuron_runtime()
        if neuron is not None:
            return neuron
        if requested == "neuron":
            raise DeviceError("train.device: got \"neuron\" but torch_xla (torch-neuronx) is not installed; "
                              "allowed here: auto, cpu")
    return Runtime("cpu", torch.device("cpu"), "gloo", "cpu", None)


def _neuron_runtime() -> Runtime | None:
    try:
        import torch_xla.core.xla_model as xm  # present only in the Neuron image
        import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" process-group backend
    except ImportError:
        return None
    return Runtime("neuron", xm.xla_device(), "xla", "NeuronCore-v2", PEAK_FLOPS["NeuronCore-v2"], xm.mark_step)
