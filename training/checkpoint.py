"""Checkpoints on the shared file system: atomic, newest-complete-wins, last K kept, optionally async.

A checkpoint is one file ``step-<step>.pt``. It is written as a hidden temporary file in the
same directory, flushed to disk, then renamed into place, and the directory is synced. A crash
at any point leaves either the old set of checkpoints or the old set plus the new one: never a
half-written file under a checkpoint name. Loading tries the newest first and falls back to
the one before if a file cannot be read (a torn copy made by some other tool, say).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
CHECKPOINT_NAME = re.compile(r"^step-(\d{9})\.pt$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}.pt"


def to_cpu(state: Any) -> Any:
    """A deep copy of ``state`` with every tensor on the host, safe to write while training goes on."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(v) for v in state)
    return state


class CheckpointManager:
    """Writes and finds checkpoints in one directory; only one write is in flight at a time."""

    def __init__(self, directory: str | Path, keep_last: int = 3, async_save: bool = False):
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.async_save = async_save
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_write_seconds = 0.0

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = (CHECKPOINT_NAME.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, step: int) -> Path:
        return self.directory / checkpoint_name(step)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Save ``state`` as ``step``. Async mode copies to host memory now and writes in the background."""
        self.wait()
        host_state = to_cpu(state)
        if not self.async_save:
            self._write(step, host_state)
            return
        self._writer = threading.Thread(target=self._write_guarded, args=(step, host_state), daemon=True)
        self._writer.start()

    def wait(self) -> None:
        """Block until the background write (if any) is on disk; re-raise its error."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def load_latest(self, map_location: str | torch.device = "cpu") -> tuple[int, dict[str, Any]] | None:
        """The newest readable checkpoint as (step, state), or None when there is none."""
        for step in reversed(self.steps()):
            try:
                return step, torch.load(self.path(step), map_location=map_location, weights_only=False)
            except Exception as exc:  # noqa: BLE001 - any unreadable file means: try the previous one
                log.warning("checkpoint %s is unreadable (%s); trying the previous one", self.path(step), exc)
        return None

    def _write_guarded(self, step: int, state: dict[str, Any]) -> None:
        try:
            self._write(step, state)
        except BaseException as exc:  # noqa: BLE001 - surfaced by wait() in the training loop
            self._error = exc

    def _write(self, step: int, state: dict[str, Any]) -> None:
        import time

        started = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        temporary = self.directory / f".{final.name}.tmp-{os.getpid()}"
        with open(temporary, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, final)
        _fsync_directory(self.directory)
        self._prune()
        self.last_write_seconds = time.perf_counter() - started

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep_last]:
            self.path(step).unlink(missing_ok=True)
        # Temporary files left by writers that were killed mid-write.
        for stale in self.directory.glob(".step-*.pt.tmp-*"):
            pid = stale.name.rsplit("-", 1)[-1]
            if pid != str(os.getpid()):
                stale.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
