"""Every rank's own step time, and the rank that is slower than the others.

A synchronous job runs at its slowest rank's pace, so the step time rank 0 reports is the same
on every rank and names nobody. What differs is the part of a step a rank spends on work of its
own, waiting on no peer: its wait for input and its forward passes. The backward pass is left out:
DDP's all-reduce runs inside it, and a fast rank spends there the time it waits for a slow one.
A GPU with a throttled clock, a node whose CPUs are shared with a noisy neighbour, or a slow input
pipeline shows up there; a degraded network link does not (every rank waits on it alike).

Each report window the trainer adds every rank's figure to the window's one all-reduce
(:func:`spread_slots`), so naming a straggler costs no extra collective. Megatron-LM's straggler
detector and NVIDIA's resiliency extension score ranks the same way, by their own kernels' time,
and report only; here a rank slower than the median by ``metrics.straggler_margin`` for
``metrics.straggler_windows`` windows in a row is named in a ``straggler`` event with its pod,
node and instance type.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from training.contract import INSTANCE_TYPE_ENV, NODE_NAME_ENV, POD_NAME_ENV


@dataclass(frozen=True)
class Place:
    """Where a rank runs: its pod, node and instance type (the job's pod spec sets them)."""

    pod: str
    node: str
    instance: str | None

    @classmethod
    def here(cls) -> "Place":
        host = socket.gethostname()
        return cls(os.environ.get(POD_NAME_ENV) or host, os.environ.get(NODE_NAME_ENV) or host,
                   os.environ.get(INSTANCE_TYPE_ENV) or None)


class ForwardTimer:
    """The time of this rank's forward passes in a report window, on the device's own clock.

    On a GPU the host only queues the kernels, so the time is taken between CUDA events on the
    compute stream and read at the report, after the window's synchronization. On XLA the host
    time is tracing, not compute: nothing is measured there (:attr:`measures` is False).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.measures = device.type in ("cpu", "cuda")
        self._host_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._started: float | torch.cuda.Event | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self._started is None:
            return
        if self.device.type == "cuda":
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            self._events.append((self._started, ended))
        else:
            self._host_s += time.perf_counter() - self._started
        self._started = None

    def take_s(self) -> float:
        """The window's forward time in seconds, and a fresh window; after the device was synchronized."""
        total = self._host_s + sum(start.elapsed_time(end) for start, end in self._events) / 1000
        self._host_s, self._events = 0.0, []
        return total


def spread_slots(own_step_s: float, rank: int, world_size: int, device: torch.device) -> Tensor:
    """This rank's figure at its own index, zeros elsewhere: summed over ranks, every rank's figure."""
    slots = torch.zeros(world_size, device=device)
    slots[rank] = own_step_s
    return slots


@dataclass(frozen=True)
class Spread:
    """The ranks' own step times in one window (seconds per step)."""

    min_s: float
    median_s: float
    max_s: float
    slowest_rank: int

    @classmethod
    def of(cls, per_rank: list[float]) -> "Spread":
        slowest = max(range(len(per_rank)), key=per_rank.__getitem__)
        return cls(min(per_rank), statistics.median(per_rank), per_rank[slowest], slowest)

    def fields(self, places: list[Place] | None) -> dict:
        """The step event's fields: the spread, and where the slowest rank runs."""
        found = {"rank_step_s": {"min": round(self.min_s, 4), "median": round(self.median_s, 4),
                                 "max": round(self.max_s, 4)}, "slowest_rank": self.slowest_rank}
        if places and self.slowest_rank < len(places):
            place = places[self.slowest_rank]
            found.update(slowest_pod=place.pod, slowest_node=place.node)
        return found


class StragglerWatch:
    """Names a rank slower than the median by ``margin`` (a fraction) in ``windows`` reports in a row.

    Once per spell: a rank named stays named until a window finds it within the margin again. A
    round's first report is not judged: it holds the round's warm-up (allocations, caches, a compile),
    which need not take every rank the same time.
    """

    WARM_UP_REPORTS = 1

    def __init__(self, margin: float, windows: int) -> None:
        self.margin = margin
        self.windows = windows
        self._behind: dict[int, int] = {}  # rank -> consecutive windows over the margin
        self._reports = 0  # in this round
        self.named: set[int] = set()

    def observe(self, per_rank: list[float]) -> list[tuple[int, float]]:
        """The ranks to name after this window: (rank, how many times the median its time is)."""
        self._reports += 1
        median = statistics.median(per_rank)
        if median <= 0 or self._reports <= self.WARM_UP_REPORTS:
            return []
        newly = []
        for rank, value in enumerate(per_rank):
            if value > median * (1 + self.margin):
                self._behind[rank] = self._behind.get(rank, 0) + 1
                if self._behind[rank] >= self.windows and rank not in self.named:
                    self.named.add(rank)
                    newly.append((rank, value / median))
            else:
                self._behind.pop(rank, None)
                self.named.discard(rank)
        return newly

    def reset(self) -> None:
        """A new round: ranks are other processes now."""
        self._behind.clear()
        self._reports = 0
        self.named.clear()
