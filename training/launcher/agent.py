"""torchrun's agent with the platform's restart accounting (used by ``python -m training.launcher``).

torch 2.13's ``SimpleElasticAgent._invoke_run`` (torch/distributed/elastic/agent/server/api.py)
takes one of ``--max-restarts`` for every failed worker group, whatever the cause, and its
``LocalElasticAgent._stop_workers`` gives the workers 30 s between SIGTERM and SIGKILL
whatever ``--shutdown-timeout`` says. A job on Spot capacity that loses a node every hour
would spend its budget in a few days, and a worker finishing a checkpoint write on a restart
would be killed mid-write. So this agent:

- ends the job at once when a worker exits with a final status (a config error, a diverged
  loss): retrying would fail the same way, on GPU nodes, for hours; and ends this node's part
  when its workers left because the node is replaced (a straggler, ``EXIT_REPLACE_NODE``);
- does not count a failure that followed progress (a newer checkpoint than at the start of
  the round) or a worker that stopped only because a peer did (exit 75). A crash loop that
  never gets past its checkpoint still runs out of restarts;
- stops workers on a restart with the same budget as on the pod's SIGTERM (the launcher's
  ``--shutdown-timeout``, on every torch release), except after a lost
  peer: then they cannot checkpoint (that needs the peer's collectives), and are stopped at once
  once a checkpoint being written is on disk;
- on an admission (every member alive), keeps the workers and moves them to the new round in
  place (:meth:`PlatformAgent._regroup`), which torchrun cannot: they pay a process-group start,
  not a restart;
- after a lost peer, also keeps the workers (:meth:`PlatformAgent._recover`): their collectives
  failed, they hold their state in memory and wait; the round re-forms without the peer and the
  survivor furthest along hands its state to the others. No step is trained again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from training.launcher import compat
from training.contract import (
    BROKEN_MARKER, CONTROL_DIR_ENV, CONTROL_FILES, EXIT_MEMBERSHIP_CHANGE, EXIT_REPLACE_NODE, FINAL_EXITS, MEMBERSHIP_FILE,
    NODE_RANKS_EVENT, LOST_PEER_SIGNAL, PAUSED_FILE, RECOVERS_MARKER, REGROUP_IN_PLACE_ENV, REGROUP_SIGNAL, STACKS_SIGNAL,
    WRITING_MARKER, control_file, control_glob,
)

log = logging.getLogger("training.launcher")
# Seconds between SIGTERM and SIGKILL for workers that lost a peer: enough to exit if they are not
# blocked in a collective, and nothing is lost by not waiting longer (no checkpoint can complete).
LOST_PEER_STOP_S = 0.5
# torchrun's default between SIGTERM and SIGKILL, when the command names no --shutdown-timeout.
DEFAULT_STOP_BUDGET_S = 30
# Seconds a worker whose collective failed waits before this agent decides no peer was lost and the
# failure was the job's own: a dead peer's lease ends within 1.5 s of its last renewal and the
# rendezvous is checked every CHECK_S (training/launcher/rendezvous.py); the rest is a margin. A large job's
# rendezvous notices a loss later (its stretched Rates, loss_noticed_within_s): it gets that and the margin.
LOST_PEER_GRACE_S = 5.0
LOST_PEER_MARGIN_S = 3.5
# Seconds the workers get to pause after a lost peer before they are restarted as torch would: a bound
# for a step, or a collective, that outlasts it (the workers shut their connections, so a collective on
# the old group fails within a fraction of a second: training/loop/regroup.py, shut_tcp_connections). A
# restarted worker holds no state and receives it from a survivor that paused: the bound costs time.
LOST_PEER_PAUSE_S = 5.0
# Seconds between copies of the regroup signal to workers that have not paused yet (see _move_paused_workers):
# longer than a step of the drills and most jobs, so a worker on its way to the pause is rarely asked twice.
ASK_AGAIN_S = 2.0


@dataclass
class Stop:
    """The newest checkpoint before and after the agent closed its workers."""

    before: int | None
    after: int | None

    @property
    def checkpointed(self) -> bool:
        return self.after is not None and (self.before is None or self.after > self.before)


@dataclass
class StopRecord:
    """What the agent's closes did, for the launcher's last word (it never sees the agent torch builds)."""

    stops: list[Stop] = field(default_factory=list)

    def last(self) -> Stop | None:
        return self.stops[-1] if self.stops else None


class PlatformAgent(LocalElasticAgent):
    def __init__(self, *args: Any, newest_checkpoint: Callable[[], int | None] = lambda: None,
                 stop_budget_s: float = DEFAULT_STOP_BUDGET_S, stops: StopRecord | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        missing = compat.missing_agent_attributes(self)
        if missing:
            raise compat.TorchIncompatible(f"torch's LocalElasticAgent has no {', '.join(missing)}")
        self._newest_checkpoint = newest_checkpoint
        # Seconds between SIGTERM and SIGKILL for the workers: the launcher's --shutdown-timeout, kept here
        # (torchrun's own flag and LaunchConfig.shutdown_timeout exist only from torch 2.13).
        self._stop_budget_s = stop_budget_s
        self._stop_timeout: float | None = None  # set by _stop_workers for the _shutdown it calls
        self._stops = stops if stops is not None else StopRecord()
        self._checkpoint_at_start: int | None = None
        self.free_restarts = 0  # failures that did not count against --max-restarts
        self._workers_failed = False  # a worker of this node failed: its siblings wait on it in collectives
        # Where the workers and this agent change rounds in place (see _regroup); None: never.
        control = os.environ.get(CONTROL_DIR_ENV)
        self._control_dir = Path(control) if control else None
        self._generation = 0
        self._in_place = self._control_dir is not None and os.environ.get(REGROUP_IN_PLACE_ENV, "1") != "0"
        self._broken_since: float | None = None  # when a worker first said its group broke (see _refuse_unexplained_breaks)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous, then one JSON line saying which global ranks this node now holds
        (torch logs them only as text, at INFO: SimpleElasticAgent._rendezvous, torch 2.13)."""
        super()._rendezvous(worker_group)
        print(json.dumps({
            "event": NODE_RANKS_EVENT, "time": time.time(), "group_rank": worker_group.group_rank,
            "group_world_size": worker_group.group_world_size,
            "global_ranks": sorted(worker.global_rank for worker in worker_group.workers),
        }), flush=True)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._checkpoint_at_start = self._newest_checkpoint()
        if self._control_dir is not None:
            # New processes count their in-place rounds from zero: so does this agent, and what the
            # old ones left (a write marker of a worker killed mid-write, their pause and membership
            # files) is stale. A generation carried over made the next regroup wait its whole stop
            # budget for a pause numbered one the new workers never reach, then restart them.
            self._generation = 0
            self._broken_since = None
            for pattern in (control_glob(kind) for kind in (WRITING_MARKER, *CONTROL_FILES)):
                for stale in self._control_dir.glob(pattern):
                    stale.unlink(missing_ok=True)
        return super()._start_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        # Whatever torch passes besides the group goes back to it (none, at 2.8 to 2.14).
        # A restart the workers can checkpoint through gets their whole budget; after a peer was
        # lost they would wait on its collectives until a timeout, so they stop at once.
        graceful = getattr(worker_group.spec.rdzv_handler, "stop_gracefully", True) and not self._workers_failed
        self._workers_failed = False
        if not graceful:
            self._wait_for_writes()
        self._stop_timeout = self._stop_budget_s if graceful else LOST_PEER_STOP_S
        try:
            super()._stop_workers(worker_group, *args, **kwargs)
        finally:
            self._stop_timeout = None

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args: Any, **kwargs: Any) -> None:
        """Close the workers with the platform's budget, then let torch finish its own shutdown.

        torch's ``_shutdown`` closes the workers with a timeout of its own: 30 s on torch 2.8
        (``_pcontext.close(death_sig)``), its ``--shutdown-timeout`` from 2.13, whose signature is
        ``(death_sig, timeout)`` where 2.8's is ``(death_sig)``. The workers are closed here
        first, through the process context's public ``close(death_sig, timeout)``; torch's close then
        finds them gone. Its other arguments go back to it as they came.
        """
        if death_sig == signal.SIGINT and threading.current_thread() is threading.main_thread():
            # A Ctrl-C reached this agent and, from the terminal, its workers, which checkpoint at
            # the end of their step and take the copy forwarded here for the same Ctrl-C
            # (training/loop/signals.py, StopRequest). torch would take a second Ctrl-C for a new
            # SignalException in the middle of this shutdown, then shut down again with the whole
            # budget (torch 2.13 elastic/agent/server/api.py, ``run``: ``finally: _shutdown``);
            # it ends this agent at once instead, and the workers with it (die_with_agent).
            signal.signal(signal.SIGINT, _exit_at_second_ctrl_c)
        if self._pcontext is not None:
            timeout = self._stop_timeout if self._stop_timeout is not None else self._stop_budget_s
            before = self._newest_checkpoint()
            self._pcontext.close(death_sig, timeout)
            self._stops.stops.append(Stop(before, self._newest_checkpoint()))
        super()._shutdown(death_sig, *args, **kwargs)

    def _wait_for_writes(self) -> None:
        """A checkpoint being written when a peer died is finished before the workers are killed:
        it is the one the job resumes from (its writer thread runs on while the main one is stuck)."""
        if self._control_dir is None:
            return
        deadline = time.monotonic() + self._stop_budget_s
        while list(self._control_dir.glob(control_glob(WRITING_MARKER))) and time.monotonic() < deadline:
            if self._pcontext is None or self._pcontext.wait(0) is not None:
                return  # the workers are gone: nothing is being written any more
            time.sleep(0.05)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """torch stops the workers and starts new ones for every new round. With an agent that
        regroups in place, this node's workers instead stay up and join the new round: when every
        member is alive (waiting nodes are admitted) and after a lost peer. A failed worker
        restarts them as torch does."""
        graceful = getattr(worker_group.spec.rdzv_handler, "stop_gracefully", False)
        if self._in_place and not self._workers_failed and (
                self._regroup(worker_group) if graceful else self._recover(worker_group)):
            return
        super()._restart_workers(worker_group)

    def _regroup(self, worker_group: WorkerGroup) -> bool:
        """Ask the workers to stop at one step and leave their group, join the next round, hand them
        their places. False (and nothing joined) when a worker did not pause within the stop budget."""
        for pid in self._pcontext.pids().values():
            os.kill(pid, REGROUP_SIGNAL)
        return self._move_paused_workers(worker_group, "regroup", self._stop_budget_s, ask_again=REGROUP_SIGNAL)

    def _recover(self, worker_group: WorkerGroup) -> bool:
        """A peer is gone: this node's workers fail their next collective (gloo; LOST_PEER_SIGNAL makes
        one blocked on a silent peer fail now), keep their state and pause (training/loop/trainer.py, ``train``).
        Join the round without the peer and hand them their places; they take the state of the
        survivor furthest along. False when they cannot (their backend, see RECOVERS_MARKER) or did
        not pause within LOST_PEER_PAUSE_S: they then restart as torch does."""
        pids = self._pcontext.pids()
        if not all((self._control_dir / control_file(RECOVERS_MARKER, local_rank)).exists() for local_rank in pids):
            return False
        for pid in pids.values():  # a worker blocked on a peer that died silently fails its collective now
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, LOST_PEER_SIGNAL)
        return self._move_paused_workers(worker_group, "recovery after a lost peer", LOST_PEER_PAUSE_S)

    def _move_paused_workers(self, worker_group: WorkerGroup, why: str, wait_s: float,
                             ask_again: int | None = None) -> bool:
        """Wait for every worker to pause for the next round, then join it and hand them their places.
        ``ask_again``: a signal sent again every ASK_AGAIN_S to workers not paused yet. A worker sets a flag
        when it arrives and acts on it at its next step, so a second copy changes nothing, but one that
        never reached the flag (a CI run once waited out its whole stop budget for a pause) is asked again."""
        pids = self._pcontext.pids()
        generation = self._generation + 1
        deadline = time.monotonic() + wait_s
        asked = time.monotonic()
        while True:
            if self._pcontext.wait(0) is not None:  # a worker exited: it is not waiting for a place
                log.warning("a worker exited instead of pausing for a %s; restarting them", why)
                return False
            if all(self._paused(local_rank, generation) for local_rank in pids):
                break
            if time.monotonic() > deadline:
                log.warning("the workers did not pause for a %s within %.0f s (%s); their stacks follow; restarting "
                            "them instead", why, wait_s, self._pause_report(pids, generation))
                for local_rank, pid in pids.items():
                    if not self._paused(local_rank, generation):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, STACKS_SIGNAL)
                time.sleep(0.5)  # the dump is written from the worker's signal handler, in C
                return False
            if ask_again is not None and time.monotonic() - asked > ASK_AGAIN_S:
                asked = time.monotonic()
                log.info("the workers have not paused for a %s yet (%s); asking again", why,
                         self._pause_report(pids, generation))
                for local_rank, pid in pids.items():
                    if not self._paused(local_rank, generation):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, ask_again)
            time.sleep(0.02)
        self._broken_since = None
        self._rendezvous(worker_group)
        spec = worker_group.spec
        for worker in worker_group.workers:
            worker.id = pids[worker.local_rank]  # the same process (torch's monitor checks the pids)
            env = {
                "RANK": str(worker.global_rank), "GROUP_RANK": str(worker_group.group_rank),
                "ROLE_RANK": str(worker.role_rank), "LOCAL_RANK": str(worker.local_rank),
                "WORLD_SIZE": str(worker.world_size), "GROUP_WORLD_SIZE": str(worker_group.group_world_size),
                "ROLE_WORLD_SIZE": str(worker.role_world_size), "MASTER_ADDR": worker_group.master_addr,
                "MASTER_PORT": str(worker_group.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(spec.max_restarts - self._remaining_restarts),
            }
            self._hand_membership(worker.local_rank, generation, env)
        self._generation = generation
        worker_group.state = WorkerState.HEALTHY
        log.info("the workers joined round %d in place (no restart, %s)", generation, why)
        return True

    def _hand_membership(self, local_rank: int, generation: int, env: dict[str, str] | None) -> None:
        target = self._control_dir / control_file(MEMBERSHIP_FILE, local_rank)
        partial = target.with_name(target.name + ".partial")
        partial.write_text(json.dumps({"generation": generation, "env": env}))
        partial.replace(target)

    def _pause_report(self, pids: dict[int, int], generation: int) -> str:
        """What each worker's pause file says, against the round this agent waited for (for the log)."""
        found = []
        for local_rank in pids:
            try:
                paused = (self._control_dir / control_file(PAUSED_FILE, local_rank)).read_text()
            except OSError:
                paused = "none"
            found.append(f"worker {local_rank}: paused {paused}")
        return f"waited for round {generation}; " + ", ".join(found)

    def _paused(self, local_rank: int, generation: int) -> bool:
        try:
            return (self._control_dir / control_file(PAUSED_FILE, local_rank)).read_text() == str(generation)
        except OSError:
            return False

    def _refuse_unexplained_breaks(self, rendezvous) -> None:
        """A worker whose collective failed waits for the round without the lost peer. When no peer
        was lost (the rendezvous reports none within LOST_PEER_GRACE_S, or what a large job's needs), the failure was the job's
        own: the worker is told so (a membership without env) and fails with its error, and the
        workers restart as after any failure."""
        if not self._in_place or self._control_dir is None:
            return
        broken = list(self._control_dir.glob(control_glob(BROKEN_MARKER)))
        if not broken:
            self._broken_since = None
            return
        now = time.monotonic()
        if self._broken_since is None:
            self._broken_since = now
        noticed = getattr(rendezvous, "loss_noticed_within_s", 0.0)
        if now - self._broken_since < max(LOST_PEER_GRACE_S, noticed + LOST_PEER_MARGIN_S):
            return
        for marker in broken:
            with contextlib.suppress(OSError, ValueError):
                generation, reason = marker.read_text().split(" ", 1)
                local_rank = int(marker.name.rsplit("-", 1)[1])
                log.warning("worker %d: %s, and no peer was lost; it fails with that error", local_rank, reason)
                # Not paused any more: a lost peer reported right after this must not move it (it is exiting).
                (self._control_dir / control_file(PAUSED_FILE, local_rank)).unlink(missing_ok=True)
                self._hand_membership(local_rank, int(generation), None)
        self._broken_since = None

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.HEALTHY:
            self._refuse_unexplained_breaks(worker_group.spec.rdzv_handler)
        if result.state == WorkerState.SUCCEEDED:
            # The job is done: close the rendezvous now, before this agent leaves it, so a pod that
            # arrives late exits at once instead of starting a round of its own.
            close = getattr(worker_group.spec.rdzv_handler, "close_round", None)
            if close is not None:
                close()
        if result.state != WorkerState.FAILED:
            return result
        self._workers_failed = True
        codes = {failure.exitcode for failure in result.failures.values()}
        if EXIT_REPLACE_NODE in codes:
            log.warning("this node's workers left the job: the node was named a straggler and is replaced "
                        "(metrics.straggler_policy=replace); the job goes on without it")
            self._remaining_restarts = 0
        elif codes & set(FINAL_EXITS):
            log.error("a worker exited %s: ending the job without a restart", sorted(codes & set(FINAL_EXITS))[0])
            self._remaining_restarts = 0
        elif codes <= {EXIT_MEMBERSHIP_CHANGE} or self._progressed():
            # _invoke_run takes one restart off after this returns; give it back first.
            self._remaining_restarts += 1
            self.free_restarts += 1
            log.info("workers exited %s after progress (newest checkpoint %s, %s at the start of the round): "
                     "this restart does not count against --max-restarts", sorted(codes),
                     self._newest_checkpoint(), self._checkpoint_at_start)
        return result

    def _progressed(self) -> bool:
        newest = self._newest_checkpoint()
        return newest is not None and (self._checkpoint_at_start is None or newest > self._checkpoint_at_start)


def _exit_at_second_ctrl_c(signum, _frame) -> None:
    os.write(2, b"second Ctrl-C: exiting now, without a checkpoint\n")  # a signal handler: no print
    os._exit(128 + signum)


def install(newest_checkpoint: Callable[[], int | None], stop_budget_s: float = DEFAULT_STOP_BUDGET_S,
            stops: StopRecord | None = None) -> None:
    """Make torch's ``launch_agent`` build a :class:`PlatformAgent`.

    ``torch.distributed.launcher.api.launch_agent`` (torch 2.8 to 2.14) constructs the agent through
    its module-level name ``LocalElasticAgent``; it has no other way to choose the class.
    tests/drills/test_launcher_torches.py fails if a torch upgrade changes that (compat.SURFACES names it).
    """
    import functools

    import torch.distributed.launcher.api as launcher_api

    launcher_api.LocalElasticAgent = functools.partial(PlatformAgent, newest_checkpoint=newest_checkpoint,
                                                       stop_budget_s=stop_budget_s, stops=stops)
