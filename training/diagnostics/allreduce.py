"""All-reduce bandwidth sweep across the job's nodes, and a check that NCCL really runs over EFA.

Run it under torchrun like a training job. It prints one row per message size, as nccl-tests
does: time, algorithm bandwidth (bytes / time) and bus bandwidth (algbw x 2(n-1)/n, the
figure to compare with the links' speed). The commonest failure on EFA clusters is NCCL
quietly falling back to TCP sockets; with ``--require-efa`` that exits non-zero.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from training.loop import agreement
from training.loop import regroup
from training.device import detect

# What NCCL (with aws-ofi-nccl) writes at init with NCCL_DEBUG=INFO.
_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.MULTILINE)
_OFI_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is (\w+)")


class TransportError(Exception):
    """NCCL did not pick the transport the job asked for."""


@dataclass(frozen=True)
class Row:
    bytes: int
    elements: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float


def bus_bandwidth(algbw: float, world_size: int) -> float:
    return algbw * 2 * (world_size - 1) / world_size if world_size > 1 else algbw


def nccl_transport(log_text: str) -> tuple[str | None, str | None]:
    """(network, OFI provider) that NCCL reported, e.g. ('Libfabric', 'efa') or ('Socket', None)."""
    network = _NETWORK.search(log_text)
    provider = _OFI_PROVIDER.search(log_text)
    return (network.group(1).strip() if network else None, provider.group(1) if provider else None)


def check_efa(log_text: str) -> str:
    """A short description of the transport, or :class:`TransportError` unless it is libfabric over EFA."""
    network, provider = nccl_transport(log_text)
    if network is None:
        raise TransportError("NCCL did not report its network; was NCCL_DEBUG=INFO set before init?")
    if "Libfabric" not in network or provider != "efa":
        raise TransportError(
            f"NCCL is using network {network!r} (OFI provider {provider!r}), not libfabric over EFA: check that "
            "the pod requests vpc.amazonaws.com/efa, the image has the EFA installer and aws-ofi-nccl, "
            "and FI_PROVIDER=efa"
        )
    return f"{network} / {provider}"


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    out, size = [], max(4, min_bytes)
    while size <= max_bytes:
        out.append(size)
        size *= 2
    return out


def sweep(device: torch.device, world_size: int, byte_sizes: list[int], iterations: int, warmup: int) -> list[Row]:
    rows = []
    for size in byte_sizes:
        elements = size // 4
        tensor = torch.ones(elements, dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(tensor)
        _sync(device)
        started = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(tensor)
        _sync(device)
        seconds = (time.perf_counter() - started) / iterations
        algbw = elements * 4 / seconds / 1e9
        rows.append(Row(elements * 4, elements, round(seconds * 1e6, 2), round(algbw, 3),
                        round(bus_bandwidth(algbw, world_size), 3)))
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_table(rows: list[Row], world_size: int, transport: str) -> str:
    lines = [f"# all_reduce sum float32, {world_size} ranks, transport: {transport}",
             f"# {'size(B)':>12} {'count':>12} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"]
    lines += [f"  {r.bytes:>12} {r.elements:>12} {r.time_us:>12.2f} {r.algbw_gbps:>12.3f} {r.busbw_gbps:>12.3f}"
              for r in rows]
    return "\n".join(lines)


def run_sweep(min_bytes: int, max_bytes: int, iterations: int, warmup: int, require_efa: bool,
              json_path: str | None) -> int:
    runtime = detect("auto")
    if runtime.backend not in ("nccl", "gloo"):
        raise TransportError(f"allreduce-bench supports nccl and gloo; this node runs {runtime.backend}")
    if require_efa and runtime.backend != "nccl":
        raise TransportError("--require-efa needs GPUs (the nccl backend); this node has none")
    nccl_log = None
    if runtime.backend == "nccl":
        nccl_log = Path(tempfile.gettempdir()) / f"nccl-{os.getpid()}.log"
        os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=str(nccl_log))
    membership = regroup.Membership.from_environment()
    regroup.init_process_group(runtime.backend, membership, runtime.device, 600)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    rows = sweep(runtime.device, world_size, sizes(min_bytes, max_bytes), iterations, warmup)
    transport, failure = "gloo (TCP)", None
    if nccl_log is not None:
        try:
            transport = check_efa(nccl_log.read_text()) if require_efa else "/".join(
                str(part) for part in nccl_transport(nccl_log.read_text()))
        except TransportError as exc:
            failure = str(exc)
    (failed_somewhere,) = agreement.any_rank(failure is not None, device=runtime.collective_device)
    if rank == 0:
        print(format_table(rows, world_size, transport), flush=True)
        if json_path:
            Path(json_path).write_text(json.dumps({"world_size": world_size, "transport": transport,
                                                   "rows": [asdict(r) for r in rows]}, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    if failure or failed_somewhere:
        print(f"error: rank {rank}: {failure or 'another rank is not on EFA'}", flush=True)
        return 3
    return 0
