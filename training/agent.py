"""torchrun's agent with the platform's restart accounting (used by ``python -m training.launch``).

torch 2.13's ``SimpleElasticAgent._invoke_run`` (torch/distributed/elastic/agent/server/api.py)
takes one of ``--max-restarts`` for every failed worker group, whatever the cause, and its
``LocalElasticAgent._stop_workers`` gives the workers 30 s between SIGTERM and SIGKILL
whatever ``--shutdown-timeout`` says. A job on Spot capacity that loses a node every hour
would spend its budget in a few days, and a worker finishing a checkpoint write on a restart
would be killed mid-write. So this agent:

- ends the job at once when a worker exits with a final status (a config error, a diverged
  loss): retrying would fail the same way, on GPU nodes, for hours;
- does not count a failure that followed progress (a newer checkpoint than at the start of
  the round) or a worker that stopped only because a peer did (exit 75). A crash loop that
  never gets past its checkpoint still runs out of restarts;
- stops workers on a restart with the same budget as on the pod's SIGTERM.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from training.launch import EXIT_MEMBERSHIP_CHANGE, FINAL_EXITS

log = logging.getLogger("training.launch")
# Seconds between SIGTERM and SIGKILL for workers that lost a peer: enough to exit if they are not
# blocked in a collective, and nothing is lost by not waiting longer (no checkpoint can complete).
LOST_PEER_STOP_S = 0.5


class PlatformAgent(LocalElasticAgent):
    def __init__(self, *args: Any, newest_checkpoint: Callable[[], int | None] = lambda: None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._newest_checkpoint = newest_checkpoint
        self._checkpoint_at_start: int | None = None
        self.free_restarts = 0  # failures that did not count against --max-restarts
        self._workers_failed = False  # a worker of this node failed: its siblings wait on it in collectives

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._checkpoint_at_start = self._newest_checkpoint()
        return super()._start_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # A restart the workers can checkpoint through gets their whole budget; after a peer was
        # lost they would wait on its collectives until a timeout, so they stop at once.
        graceful = getattr(worker_group.spec.rdzv_handler, "stop_gracefully", True) and not self._workers_failed
        self._workers_failed = False
        self._shutdown(timeout=self._shutdown_timeout if graceful else LOST_PEER_STOP_S)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
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
        if codes & set(FINAL_EXITS):
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


def install(newest_checkpoint: Callable[[], int | None]) -> None:
    """Make torch's ``launch_agent`` build a :class:`PlatformAgent`.

    ``torch.distributed.launcher.api.launch_agent`` (torch 2.13) constructs the agent through
    its module-level name ``LocalElasticAgent``; it has no other way to choose the class.
    tests/test_restart_budget.py fails if a torch upgrade changes that.
    """
    import functools

    import torch.distributed.launcher.api as launcher_api

    launcher_api.LocalElasticAgent = functools.partial(PlatformAgent, newest_checkpoint=newest_checkpoint)
