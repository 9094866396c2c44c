"""Rank 0 reads and writes checkpoints while the other ranks wait outside every collective.

A collective waits ``distributed.timeout_s`` for its slowest rank, and that timeout stays short:
it is how a peer that stopped answering is noticed. Rank 0 reading a checkpoint to resume, or
writing one while the others must wait (a stop, a spot notice, the end of the run, a
synchronous or overdue write), is no such peer, and takes what the bytes take (3.75 GiB: ~13 s
on the default FSx; a bigger model more than any step timeout). So rank 0 announces in the
process group's key-value store how many bytes it is about to move, moves them, and says when
it is done; the others poll the store for that, for as long as the bytes may take at
``checkpoint.min_throughput_mb_s`` plus a margin, and only then join rank 0 in a barrier that
every rank reaches at once.

A rank 0 that dies meanwhile is noticed by the agents (its lease, seconds) and the round is
restarted; otherwise the others give up at their deadline, naming the setting.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
# Seconds for what is not proportional to the bytes on a slow file system: listing, probing and
# renaming files, fsync; also how long the others wait for rank 0 to announce the bytes.
MARGIN_S = 60.0
FIRST_POLL_S = 0.01
LAST_POLL_S = 0.25
DONE, FAILED = "done", "failed"


class RankZeroIOError(RuntimeError):
    """Rank 0's checkpoint read or write failed, or outlasted what the other ranks allow it."""


def deadline_s(nbytes: int, min_throughput_mb_s: float) -> float:
    """How long the other ranks wait for rank 0 to move ``nbytes``."""
    return MARGIN_S + nbytes / (min_throughput_mb_s * 1e6)


def tensor_bytes(*states: Any) -> int:
    """Bytes of the tensors in nested dicts, lists and tuples (a state dict's size, nearly its file's)."""
    total = 0
    pending = list(states)
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            total += value.nbytes
        elif isinstance(value, dict):
            pending += value.values()
        elif isinstance(value, (list, tuple)):
            pending += value
    return total


def file_bytes(paths: Iterable) -> int:
    """Bytes of the files that exist among ``paths``."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):  # gone meanwhile (pruned, set aside): nothing to read there
            total += path.stat().st_size
    return total


def xla_barrier(device: torch.device) -> Callable[[], None]:
    """A barrier for the ``xla`` group, whose own ``barrier`` returns at once without waiting for
    anyone (torch_xla 2.8.0 torch_xla/distributed/xla_backend.py, ProcessGroupXla.barrier): an
    all-reduce of one number, read back, which XLA runs, with every rank, when it is read."""
    def barrier() -> None:
        token = torch.zeros(1, device=device)
        dist.all_reduce(token)
        token.cpu()
    return barrier


class RankZeroIO:
    """Runs rank 0's checkpoint I/O with the other ranks waiting for it in the store, not in a collective.

    Every rank calls :meth:`run` at the same point, in the same order (as it would a collective);
    ``prefix`` is agreed by the ranks of this round, so no key of an earlier round answers.
    """

    def __init__(self, rank: int, store: Any | None, prefix: str, min_throughput_mb_s: float,
                 barrier: Callable[[], Any] = dist.barrier) -> None:
        self.rank = rank
        self.store = store
        self.prefix = prefix
        self.min_throughput_mb_s = min_throughput_mb_s
        self.barrier = barrier
        self._count = 0

    @classmethod
    def for_group(cls, prefix: str, min_throughput_mb_s: float, device: torch.device | None = None) -> "RankZeroIO":
        """With the process group's store; without a group, rank 0 alone (nobody waits).
        ``device`` is where the group's collectives take their tensors (Runtime.collective_device).

        torch has no public getter for the default group's store; ``_get_default_store`` is the
        one torch's own c10d code uses (torch 2.13 torch/distributed/distributed_c10d.py).
        """
        if not dist.is_initialized():
            return cls(0, None, prefix, min_throughput_mb_s)
        barrier = xla_barrier(device) if device is not None and device.type == "xla" else dist.barrier
        return cls(dist.get_rank(), dist.distributed_c10d._get_default_store(), prefix, min_throughput_mb_s, barrier)

    def run(self, what: str, size: Callable[[], int], work: Callable[[], T]) -> T | None:
        """Rank 0: announce ``size()`` bytes, run ``work`` (its result is returned), say how it ended.
        Other ranks: wait for that, then return None; raise if it failed or outlasted its deadline.
        ``what`` names the operation for the messages ("read the checkpoint to resume")."""
        if self.store is None:
            return work()
        self._count += 1
        key = f"{self.prefix}/{self._count}"
        result = None
        if self.rank == 0:
            self.store.set(f"{key}/bytes", str(size()))
            outcome = FAILED
            try:
                result = work()
                outcome = DONE
            finally:
                self.store.set(f"{key}/end", outcome)
        else:
            nbytes = int(self._wait(f"{key}/bytes", MARGIN_S, f"to start to {what}"))
            limit = deadline_s(nbytes, self.min_throughput_mb_s)
            if self._wait(f"{key}/end", limit, f"to {what} ({nbytes / 2**30:.2f} GiB)") != DONE:
                raise RankZeroIOError(f"rank 0 failed to {what}; its log says why")
        # Every rank is here, or about to be: rank 0 does not go on (nor exit, where its process
        # holds the store) before the others have seen it done.
        self.barrier()
        return result

    def _wait(self, key: str, limit_s: float, what: str) -> str:
        """The key's value once rank 0 set it. Polled with ``check`` (it answers at once, where a
        ``wait`` that times out would be logged by the store's client each time)."""
        deadline = time.monotonic() + limit_s
        pause = FIRST_POLL_S
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise RankZeroIOError(
                    f"checkpoint.min_throughput_mb_s: rank 0 took more than {limit_s:.0f} s {what} "
                    f"(at least {self.min_throughput_mb_s:g} MB/s, plus {MARGIN_S:.0f} s); allowed: a lower value for "
                    "a slower file system")
            time.sleep(pause)
            pause = min(LAST_POLL_S, pause * 2)
        return self.store.get(key).decode()
