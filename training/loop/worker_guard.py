"""The first thing a worker does: make sure it never trains alone after its agent is gone. Standard library only."""

from __future__ import annotations

import logging
import os
import sys

from training.contract import AGENT_PID_ENV

_PR_SET_PDEATHSIG = 1
log = logging.getLogger("training.loop.worker_guard")


def die_with_agent() -> None:
    """First thing in a worker: ask Linux to SIGKILL it when its agent dies, and exit if it already has.

    torchrun starts workers in their own session, so a killed agent (OOM, a pod deleted with
    force) would leave them training alone, holding the GPUs and writing checkpoints. The
    request is made before anything slow (importing torch takes seconds), and the parent (or,
    under the launcher's forkserver, the parent's parent) is compared with the pid the launcher
    exported: an agent that died before the request took effect has left this worker with another
    parent. Needs only the standard library.
    """
    expected = os.environ.get(AGENT_PID_ENV)
    if expected is None and "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # not under an agent: a local run or a test
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if expected is not None and int(expected) not in (os.getppid(), _parent_of(os.getppid())):
        print(f"the agent (pid {expected}) is gone; this worker exits instead of training alone", file=sys.stderr)
        os._exit(1)


def _parent_of(pid: int) -> int | None:
    """The parent of ``pid`` (Linux's /proc), None when it cannot be read. A worker of the packaged
    trainer is forked by the agent's forkserver (training/launcher/workers.py), whose parent is the
    agent; the server dies with the agent, and with it (PR_SET_PDEATHSIG) the worker."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ")" ends it.
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
