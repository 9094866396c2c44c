"""The trainer's checkpointing component: when a save is due, writing it, and what the agent and
the logs are told about it. Only rank 0 writes; every rank asks it the same questions."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from training.loop.checkpoint import CheckpointManager, Saved
from training.loop.metrics import MetricsWriter
from training.loop.save_policy import SavePolicy

log = logging.getLogger(__name__)
# A checkpoint write longer than this share of the stop budget is warned about.
STOP_BUDGET_SHARE = 0.8
# Seconds of the stop budget kept back when a dying trainer waits for its checkpoint write.
EXIT_MARGIN_S = 5


class Checkpointer:
    """``manager`` writes and reads the files; ``policy`` decides when; this keeps the agent's
    write marker (the agent waits for it before a SIGKILL), the step time the policy plans
    asynchronous writes with, and the warning when a write outgrows the stop budget."""

    def __init__(self, manager: CheckpointManager, policy: SavePolicy, metrics: MetricsWriter,
                 stop_budget_s: float, writing_marker: Path | None):
        self.manager = manager
        self.policy = policy
        self.metrics = metrics
        self.stop_budget_s = stop_budget_s
        self.writing_marker = writing_marker
        self.step = 0  # the trainer's step, as of its last report here
        self.recent_step_s: float | None = None  # moving average of the step time
        self._budget_warned = False
        manager.on_saved = self._announce
        manager.on_set_aside = self._set_aside

    def stepped(self, step: int, step_time_s: float) -> None:
        self.step = step
        self.recent_step_s = step_time_s if self.recent_step_s is None else (
            0.9 * self.recent_step_s + 0.1 * step_time_s)

    def due(self, step: int) -> bool:
        return self.policy.due(step, self.manager.in_flight)

    def ask_ahead(self, step: int) -> bool:
        return self.policy.ask_ahead(step, self.manager.in_flight)

    def hold_ahead(self, step: int) -> bool:
        return self.policy.hold_ahead(step, self.manager.in_flight)

    def keep_loss_bound(self, step: int) -> None:
        """Before the next step: never train more than one interval past the newest checkpoint on
        disk (a kill then loses at most ``checkpoint.interval_steps`` steps)."""
        if self.policy.must_wait(step, self.manager.in_flight):
            self.manager.wait()

    def write(self, step: int, state: dict[str, Any], reason: str, synchronous: bool) -> None:
        """Rank 0: write ``state`` as step ``step``; asynchronously unless ``synchronous`` or the config says not."""
        asynchronous = self.manager.async_save and not synchronous
        self.metrics.event("checkpoint_started", step=step, reason=reason, asynchronous=asynchronous,
                           stop_budget_s=self.stop_budget_s)
        if self.writing_marker is not None:
            self.writing_marker.touch()
        self.manager.save(step, state, asynchronous=asynchronous)
        last = self.manager.last_saved
        if last is not None and last.write_s > STOP_BUDGET_SHARE * self.stop_budget_s and not self._budget_warned:
            self._budget_warned = True
            log.warning("a checkpoint takes %.1f s to write, more than %.0f%% of the %.0f s a SIGTERM leaves "
                        "before SIGKILL: raise the pod's grace period or write less", last.write_s,
                        100 * STOP_BUDGET_SHARE, self.stop_budget_s)

    def _announce(self, saved: Saved) -> None:
        """The file is durable. Called from the writer thread when asynchronous."""
        if self.writing_marker is not None:
            self.writing_marker.unlink(missing_ok=True)
        spanned = max(0, self.step - saved.step)  # steps trained while it was written
        self.policy.saved(saved.step, saved.write_s, self.recent_step_s)
        self.metrics.event("checkpoint_saved", step=saved.step, path=str(saved.path), bytes=saved.bytes,
                           write_s=round(saved.write_s, 3), blocking_s=round(saved.blocking_s, 4),
                           steps_during_write=spanned)

    def _set_aside(self, where: Path, files: list[str]) -> None:
        """Retention moved unreadable checkpoints out of the way (kept there for a look)."""
        self.metrics.event("checkpoints_set_aside", path=str(where), files=files)

    def finish_writing(self) -> None:
        """On the way out (an error, a lost peer): wait, within the stop budget, for the write in flight."""
        if not self.manager.in_flight:
            return
        bound = max(1.0, self.stop_budget_s - EXIT_MARGIN_S)
        log.warning("waiting up to %.0f s for the checkpoint being written before exiting", bound)
        try:
            if not self.manager.wait(timeout=bound):
                log.error("the checkpoint write did not finish within %.0f s; the job resumes from the one before",
                          bound)
        except Exception as exc:  # noqa: BLE001 - exiting anyway; say why the write failed
            log.error("the checkpoint write failed: %s", exc)
