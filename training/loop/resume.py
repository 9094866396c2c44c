"""Where a (re)started job goes on from: rank 0 reads the newest usable checkpoint, starts fresh,
or refuses with the reason, before any rank trains."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from training.loop.checkpoint import CheckpointError, CheckpointManager
from training.loop.state import mismatch

log = logging.getLogger(__name__)


def decide(checkpoints: CheckpointManager, signature: dict[str, Any], model: dict[str, torch.Tensor],
           if_unusable: str) -> dict[str, Any]:
    """Rank 0 alone: probe the directory, read the newest usable checkpoint, or say why not.

    ``kind`` is ``resume`` (with the step, path and state), ``fresh``, or ``refuse`` (with the
    message); ``if_unusable="start_fresh"`` sets unusable checkpoints aside instead of refusing.
    """
    started = time.perf_counter()
    try:
        checkpoints.probe()
    except CheckpointError as exc:
        return {"kind": "refuse", "message": str(exc)}
    newest = checkpoints.load_newest()
    if newest.state is None and not newest.unreadable:
        return {"kind": "fresh"}
    if newest.state is None:
        problem = (f"checkpoint.dir: none of the {len(newest.unreadable)} checkpoint(s) in {checkpoints.directory} "
                   f"can be read (newest {newest.unreadable[0]})")
    else:
        problem = mismatch(newest.state, signature, model)
        if problem is None:
            return {"kind": "resume", "step": newest.step, "path": str(newest.path), "state": newest.state,
                    "bytes_read": newest.bytes_read, "read_s": time.perf_counter() - started,
                    "unreadable": newest.unreadable}
        problem = f"checkpoint.dir: {newest.path} does not fit this job: {problem}"
    if if_unusable == "start_fresh" and newest.state is None and newest.io_errors:
        # The file system failed to read a file (after retries), which says nothing of the file:
        # starting at step 0 would throw away a run that a later restart can resume.
        name, reason = newest.io_errors[0].split(": ", 1)
        return {"kind": "refuse", "message": f"checkpoint.dir: {checkpoints.directory / name} {reason}; not "
                                             "starting fresh over checkpoints that may be intact (checkpoint."
                                             "if_unusable=start_fresh); allowed: run again once the file system "
                                             "reads them, or another checkpoint.dir"}
    if if_unusable == "start_fresh":
        where = checkpoints.set_aside()
        log.warning("%s; moved every checkpoint to %s and starting at step 0 (checkpoint.if_unusable="
                    "start_fresh)", problem, where)
        return {"kind": "fresh", "set_aside": str(where)}
    return {"kind": "refuse", "message": f"{problem}; allowed: another checkpoint.dir, or "
                                         "checkpoint.if_unusable=start_fresh to set them aside and start at step 0"}
