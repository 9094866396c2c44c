"""What a worker under torchrun needs to survive elasticity: membership, timeouts, signals, its agent."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Membership:
    """This worker's place in the current rendezvous round; it changes on every restart."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    restart_count: int
    run_id: str

    @classmethod
    def from_environment(cls) -> "Membership":
        env = os.environ
        return cls(
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            node_rank=int(env.get("GROUP_RANK", "0")),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            run_id=env.get("TORCHELASTIC_RUN_ID", "local"),
        )

    @property
    def distributed(self) -> bool:
        return "MASTER_ADDR" in os.environ  # set by torchrun, even for a single worker


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its torchrun agent dies.

    torchrun starts workers in their own session, so a killed agent (OOM, a pod deleted with
    force) would leave them training as ghosts that hold the rendezvous and the GPUs.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent:  # the agent died before the request took effect
        os._exit(1)


_received_signal: str | None = None


def received_signal() -> str | None:
    """The stop signal this process received, if any (the launcher's forked workers ask)."""
    return _received_signal


class StopRequest:
    """Set by SIGTERM (spot interruption, eviction, torchrun shutting down); read between steps."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        global _received_signal
        self.signal_name = _received_signal = signal.Signals(signum).name
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()


def init_process_group(backend: str, membership: Membership, device: torch.device, timeout_s: int) -> None:
    """Join the process group of this rendezvous round with an explicit timeout."""
    if not membership.distributed or dist.is_initialized():
        return
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)


def shorten_timeout(seconds: int) -> None:
    """After warm-up, a peer that stops answering must fail the step in seconds, not 30 minutes.

    torch has no public setter for an existing group's timeout; ``_set_pg_timeout`` is the one
    torch itself uses and tests (gloo and nccl).
    """
    if dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on any rank (one tiny all-reduce)."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)
