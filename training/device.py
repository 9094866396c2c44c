"""The device layer: one trainer for CUDA GPUs (nccl), Trainium (torch-neuronx, XLA) and CPU (gloo)."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accelerator:
    """One device model's peak, for MFU."""

    model: str  # the accelerator_model of config/catalog.py (tests/unit/test_device_peaks.py keeps the two in step)
    peak_flops: float  # dense bf16/fp16 tensor FLOPS of one device (a chip), no sparsity
    source: str  # the vendor's data sheet
    # Trainium: physical NeuronCores per chip, and how many make one logical core unless
    # NEURON_LOGICAL_NC_CONFIG says otherwise (torchrun runs one process per logical core).
    neuron_cores: int = 0
    default_lnc: int = 1


_V100 = "NVIDIA Tesla V100 data sheet (SXM2): 125 TFLOPS tensor"
_A100 = "NVIDIA A100 data sheet: BF16/FP16 tensor 312 TFLOPS (624 with sparsity)"
_H100 = "NVIDIA H100 data sheet, SXM: BF16/FP16 tensor 1,979 TFLOPS with sparsity, half without"
# Torch names the H200 NVL (835 TFLOPS) "NVIDIA H200" too; AWS sells the SXM part (p5e, p5en).
_H200 = "NVIDIA H200 data sheet, SXM: BF16/FP16 tensor 1,979 TFLOPS with sparsity, half without"
# Not the A10's 125: like GA102's GeForce parts, the g5's A10G runs bf16 with fp32 accumulation at
# half the fp16-accumulate rate; 80 SMs at 1.71 GHz give 70 (karpathy/llm.c llmc/mfu.h scales its
# AMPERE_CONSUMER figures by tensor cores and clock the same way).
_A10G = "NVIDIA A10G for AWS data sheet (NVIDIA_AWS_A10G_DataSheet_FINAL_02_17_2022.pdf): BF16 tensor 70 TFLOPS"
_L4 = "NVIDIA L4 data sheet: BF16/FP16 tensor 242 TFLOPS with sparsity, half without"
_L40S = "NVIDIA L40S data sheet: BF16/FP16 tensor 362.05 TFLOPS (733 with sparsity)"
_TRAINIUM = "AWS Neuron docs, Trainium architecture: 2 NeuronCore-v2 deliver 190 FP16/BF16 TFLOPS"
_TRAINIUM2 = "AWS Neuron docs, Trainium2 architecture: 8 NeuronCore-v3 deliver 667 BF16/FP16 TFLOPS (dense)"

# The one table of peak FLOPS, keyed by the device's name as its runtime gives it: CUDA's
# (torch.cuda.get_device_name), and for Trainium the chip (see _neuron_runtime). A name is found
# exactly, spaces and case aside (device_key), never as a substring: "L4" is in "NVIDIA L40S",
# "H100" in "NVIDIA H100 PCIe" (756 TFLOPS). A device not here reports no MFU rather than a wrong one.
ACCELERATORS: dict[str, Accelerator] = {
    "Tesla V100-SXM2-16GB": Accelerator("V100", 125e12, _V100),  # p3
    "Tesla V100-SXM2-32GB": Accelerator("V100", 125e12, _V100),  # p3dn
    "NVIDIA A10G": Accelerator("A10G", 70e12, _A10G),  # g5
    "NVIDIA L4": Accelerator("L4", 121e12, _L4),  # g6
    "NVIDIA L40S": Accelerator("L40S", 362.05e12, _L40S),  # g6e
    "NVIDIA A100-SXM4-40GB": Accelerator("A100", 312e12, _A100),  # p4d
    "NVIDIA A100-SXM4-80GB": Accelerator("A100", 312e12, _A100),  # p4de
    "NVIDIA H100 80GB HBM3": Accelerator("H100", 989e12, _H100),  # p5
    "NVIDIA H200": Accelerator("H200", 989e12, _H200),  # p5e, p5en
    "Trainium": Accelerator("Trainium", 190e12, _TRAINIUM, neuron_cores=2),  # trn1, trn1n
    "Trainium2": Accelerator("Trainium2", 667e12, _TRAINIUM2, neuron_cores=8, default_lnc=2),  # trn2
}
# The Trainium chip of each EC2 instance family (the family names the chip; the catalog's trn* types).
NEURON_FAMILIES = {"trn1": "Trainium", "trn1n": "Trainium", "trn2": "Trainium2"}


def device_key(name: str) -> str:
    """A device name for exact lookup: case and runs of spaces do not count."""
    return " ".join(name.split()).casefold()


_BY_KEY = {device_key(name): accelerator for name, accelerator in ACCELERATORS.items()}
_unknown_logged: set[str] = set()


def accelerator(name: str) -> Accelerator | None:
    """The table's entry for the device called ``name``; None, said once per name, when it has none."""
    found = _BY_KEY.get(device_key(name))
    if found is None and name not in _unknown_logged:
        _unknown_logged.add(name)
        log.warning("no peak FLOPS known for device %r, so no MFU is reported; known: %s", name,
                    ", ".join(ACCELERATORS))
    return found


def peak_flops(name: str) -> float | None:
    """Dense bf16/fp16 peak FLOPS of one device called ``name`` (a CUDA device's name); None if unknown."""
    found = accelerator(name)
    return found.peak_flops if found else None


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
        if precision not in ("fp32", "bf16", "fp16"):  # "auto" must be resolved first (Runtime.precision)
            raise ValueError(f"autocast takes fp32, bf16 or fp16, the precision Runtime.precision chose; got {precision!r}")
        if precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        device_type = "cpu" if self.kind == "cpu" else ("xla" if self.kind == "neuron" else "cuda")
        return torch.autocast(device_type=device_type, dtype=dtype)

    @property
    def collective_device(self) -> torch.device:
        """Where the process group's collectives take their tensors: host memory for gloo; the
        device for NCCL and for the ``xla`` group, whose every collective is an op of the XLA
        graph on device tensors (torch_xla 2.8.0 torch_xla/distributed/xla_backend.py,
        ProcessGroupXla: ``xm.all_reduce``, ``xm.collective_broadcast``, ``xm.all_gather``)."""
        return torch.device("cpu") if self.backend == "gloo" else self.device

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
        return Runtime("cuda", torch.device("cuda", local_rank), "nccl", name, peak_flops(name),
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
    name, peak = neuron_device(_instance_type(), os.environ.get("NEURON_LOGICAL_NC_CONFIG"))
    return Runtime("neuron", xm.xla_device(), "xla", name, peak, xm.mark_step)


def neuron_device(instance_type: str, lnc: str | None) -> tuple[str, float | None]:
    """The Trainium chip of ``instance_type`` and the peak of one process on it.

    torchrun runs one process per logical NeuronCore: one physical core on Trainium (which has
    no other setting), ``lnc`` of them (NEURON_LOGICAL_NC_CONFIG, 2 unless set) on Trainium2 (AWS
    Neuron docs, "Logical NeuronCore configuration"). A process's peak is the chip's over the
    logical cores on the chip.
    """
    chip = NEURON_FAMILIES.get(instance_type.split(".", 1)[0], f"Neuron device of {instance_type or 'unknown type'}")
    found = accelerator(chip)
    if found is None:
        return chip, None
    group = int(lnc) if found.default_lnc > 1 and lnc and lnc.isdigit() and int(lnc) > 0 else found.default_lnc
    return chip, found.peak_flops * group / found.neuron_cores


def _instance_type() -> str:
    """The EC2 instance type, from the DMI product name, where Neuron's own tools read the
    platform (aws-neuron/nkipy, nkipy/src/nkipy/core/compile.py get_platform_target, commit
    a8eb03c); empty where it cannot be read."""
    try:
        with open("/sys/devices/virtual/dmi/id/product_name") as handle:
            return handle.readline().strip()
    except OSError:
        return ""
