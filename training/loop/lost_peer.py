"""What lets a worker keep its state when a peer dies in the middle of a step, with NCCL as with gloo.

gloo fails the collective in the main thread, before the update that needs it runs. NCCL fails
silently: the host has queued the step (and often the next) before the device ran it, the kernels
of a collective that lost a peer wait forever, and when the communicator is aborted they end early
and everything queued after them runs on what they left, the update included ("subsequent GPU
operations might run on corrupted/incomplete data", torch ``ProcessGroupNCCL::handleException``).
Nor does a later collective's result say that an earlier one completed: on an H100 (torch 2.11,
NCCL 2.28.9, three ranks on one GPU) a one-element all-reduce queued after an aborted gradient
all-reduce still summed all three ranks' ones, the dead rank's contribution having arrived first.

So the guard decides on the device, not in a collective:

- :class:`GroupGuard` holds a flag every step's update reads when it runs (a fused optimizer's
  ``found_inf``: the update, momentum and Adam's step count included, is skipped when it is 1;
  torch 2.8 to 2.14, ``torch.optim.SGD``/``AdamW`` read ``self.found_inf``, the CUDA kernels skip on
  ``*found_inf_ptr == 1``, fused_adam_utils.cuh; the CPU kernels likewise). The flag is set, and
  seen to be set on the device, before the group is aborted: an update whose all-reduce the abort
  cut short can only run after the abort, so it reads 1 and is skipped; an update that read 0 ran
  on a completed all-reduce.
- :class:`StepLedger` counts on the device the updates that were applied, and keeps the host's
  progress and the BatchNorm buffers from before each step still in flight: once the device has
  run what was queued, the count says which step the weights hold, and the ledger puts the
  progress and the buffers back to that step.

The main thread learns of the abort from :meth:`GroupGuard.check`, called after each host read of a
reduced value (the agreement's flags, a report's loss, an evaluation's sums, a save's weights), so
a value the abort cut short is never acted on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from training.loop.regroup import shut_tcp_connections
from training.loop.state import Progress

log = logging.getLogger(__name__)

# Seconds between two looks at the NCCL group's error state (Backend.get_error, torch 2.8 to 2.14).
POLL_S = 0.1
# Seconds a worker waits for the abort of its NCCL group before it gives up keeping its state (it
# then exits, and restarts from the checkpoint): within the agent's LOST_PEER_PAUSE_S (5 s).
ABORT_WAIT_S = 4.0
# Steps the host may have queued beyond the device's: the agreement is read one step late
# (agreement.LaggedAgreement), so the device runs at most two steps behind; one more for margin.
STEPS_IN_FLIGHT = 3


class GroupBroken(RuntimeError):
    """The process group was aborted under this worker (a lost peer, or its own error state):
    what it computed since then is not to be used. A RuntimeError, as torch's collective errors are."""


class GroupGuard:
    """The flag that skips updates once the group is broken, and the breaking itself."""

    def __init__(self, device: torch.device, backend: str) -> None:
        self.device = device
        self.backend = backend
        self.skip = torch.zeros((), device=device)  # 1.0: updates from now on are skipped
        self.broken = threading.Event()
        self.ended = threading.Event()  # the group's work has ended: aborted (NCCL) or disconnected (gloo)
        self.reason = ""
        self._lock = threading.Lock()
        self._round = 0
        # Its own stream: the compute stream may be blocked behind the hung collective.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def break_group(self, reason: str) -> bool:
        """From any thread: skip every update not yet run, then abort the group so that the hung
        kernels end. False when it was broken already."""
        with self._lock:
            if self.broken.is_set():
                return False
            # Said first: the main thread stops acting on reduced values now (it checks ``broken``),
            # before the group is aborted, which is what could cut a collective short.
            self.reason = reason
            self.broken.set()
            self._set_skip(1.0)
        log.warning("the process group is broken (%s): updates not yet run are skipped", reason)
        try:
            if self.backend == "nccl":
                if dist.is_initialized():
                    # Returns once ncclCommAbort has (torch ProcessGroupNCCL::abort, torch 2.8 to 2.14): the
                    # group leaves the world and the hung kernels end (0.4 to 0.8 s on an H100, torch 2.11).
                    started = time.perf_counter()
                    dist.distributed_c10d._abort_process_group()
                    log.warning("the NCCL group is aborted (%.2f s)", time.perf_counter() - started)
            elif dist.is_initialized():
                # Its peers may be blocked in the same step, waiting for data that passes through ranks
                # that already gave up: gloo exchanges with a few peers per step, so only the dead peer's
                # neighbours fail at once, and the rest wait out their timeout (5 of 7 survivors at 8 ranks,
                # for minutes). gloo has no abort (``Backend::abort`` is empty; torch 2.13
                # torch/csrc/distributed/c10d/Backend.hpp), and the group's C++ objects outlive Python's
                # references, so its connections stay open. Shut here instead, each peer waiting on this
                # worker fails at once and does the same: the failure crosses the group in a fraction of a
                # second (benchmarks/elastic_recovery.py --lost-node).
                log.warning("shut %d connection(s) of this round", shut_tcp_connections())
        except Exception as exc:  # noqa: BLE001 - on a thread of its own: said, and the worker gives up (wait_ended)
            log.error("ending the broken group's work failed: %s", exc)
            return True
        self.ended.set()
        return True

    def wait_ended(self) -> bool:
        """In the main thread: has the group's work ended (within ABORT_WAIT_S)? Until then the
        device may still run a hung collective, and a synchronization would wait for it."""
        if self.ended.wait(ABORT_WAIT_S):
            return True
        log.error("the broken group's abort did not return within %.0f s; this worker restarts from the checkpoint",
                  ABORT_WAIT_S)
        return False

    def _set_skip(self, value: float) -> None:
        """On the guard's stream, done when it returns: the compute stream may be blocked."""
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                self.skip.fill_(value)
            self._stream.synchronize()
        else:
            self.skip.fill_(value)

    def drained(self, timeout_s: float | None = None) -> bool:
        """Whether the device has run everything queued on the current stream, found by polling an
        event: never a blocking synchronization, which a collective hung on a dead peer would hold
        until the abort (the first H100 try hung in one). False once ``timeout_s`` has passed, or,
        without one, once the group broke."""
        if self._stream is None:
            return True  # the host's own work is done when it returns
        queued = torch.cuda.Event()
        queued.record()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not queued.query():
            if self.broken.is_set() if deadline is None else time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def wait_for_device(self) -> None:
        """Until the device has run everything queued; raise if the group broke meanwhile."""
        self.drained()
        self.check()

    def check(self) -> None:
        """In the main thread, after reading a value the group reduced: raise if it may be cut short."""
        if self.broken.is_set():
            raise GroupBroken(f"the process group was aborted: {self.reason}")

    def step_skip(self) -> Tensor:
        """This step's copy of the flag, taken on the device after the step's all-reduce: the
        update and the ledger read the same value."""
        return self.skip.clone()

    def start_round(self) -> None:
        """A new group of the next round (in the main thread, the old group gone): updates apply again."""
        with self._lock:
            self._round += 1
            self._set_skip(0.0)
            self.broken.clear()
            self.ended.clear()
            self.reason = ""
        if self.backend == "nccl":
            threading.Thread(target=self._watch_errors, args=(self._round,), name="nccl-error-watch",
                             daemon=True).start()

    def _watch_errors(self, round_: int) -> None:
        """The NCCL group's own error state (a peer's connection closed, a collective timed out):
        the watchdog records it, and with TORCH_NCCL_ASYNC_ERROR_HANDLING=0 does nothing else
        (see regroup.RECOVERING_NCCL_ENVIRONMENT); this breaks the group the same way the agent's signal does."""
        try:
            from torch._C._distributed_c10d import ErrorType

            backend = dist.group.WORLD._get_backend(self.device)
        except (AttributeError, ImportError, RuntimeError, ValueError) as exc:
            log.warning("cannot watch the NCCL group's errors (%s); a lost peer is noticed by the agent only", exc)
            return
        while self._round == round_ and not self.broken.is_set():
            try:
                error = backend.get_error()
            except RuntimeError:
                return  # the group is gone
            if error != ErrorType.SUCCESS:
                if self._round == round_:  # not a group of a round that has ended meanwhile
                    self.break_group(f"NCCL reports {error.name}")
                return
            time.sleep(POLL_S)


@dataclass
class _Before:
    progress: Progress
    slot: int  # the ring slot of the buffers
    optimizer_empty: bool  # the optimizer had no state yet (its first update creates it)


class StepLedger:
    """Which step the weights hold when the host has queued steps the device may not have run."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.applied = torch.zeros((), dtype=torch.float64, device=device)  # updates applied since ``base``
        self.base = 0
        self._buffers = list(module.buffers())
        self._ring = [[torch.empty_like(b) for b in self._buffers] for _ in range(STEPS_IN_FLIGHT)]
        self._before: deque[_Before] = deque(maxlen=STEPS_IN_FLIGHT)
        self._next_slot = 0

    def start(self, step: int) -> None:
        """Count from ``step``: the state the weights hold now (a round's start)."""
        self.applied.zero_()
        self.base = step
        self._before.clear()

    def before_step(self, progress: Progress, optimizer: torch.optim.Optimizer) -> None:
        slot = self._next_slot
        self._next_slot = (slot + 1) % STEPS_IN_FLIGHT
        if self._buffers:
            torch._foreach_copy_(self._ring[slot], self._buffers)
        self._before.append(_Before(replace(progress), slot, not optimizer.state))

    def after_update(self, skip: Tensor) -> None:
        self.applied.add_(1.0 - skip.to(self.applied.dtype))

    def held_step(self) -> int:
        """The step the weights hold; call once the device has run everything queued."""
        return self.base + int(self.applied.item())

    def restore(self, progress: Progress, optimizer: torch.optim.Optimizer) -> Progress | None:
        """After a broken step: the progress of the step the weights hold, with the buffers of that
        moment put back. None when that step is no longer kept (the worker cannot recover)."""
        held = self.held_step()
        before = next((b for b in self._before if b.progress.step == held), None)
        if before is None:
            return progress if held == progress.step else None
        with torch.no_grad():
            if self._buffers:
                torch._foreach_copy_(self._buffers, self._ring[before.slot])
        if before.optimizer_empty:
            # A first update that was skipped leaves SGD's momentum buffers uninitialized
            # (torch.optim.SGD creates them empty and fills them in that update): start them again.
            optimizer.state.clear()
        self._before.clear()
        return before.progress
