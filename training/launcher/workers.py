"""The packaged trainer's warm workers: started by a forkserver that imported the trainer, never forked from the agent.

A worker forked from the agent cannot use CUDA. torch's ``LaunchConfig.__post_init__`` calls
``torch.cuda.is_available()`` in the agent (torch 2.13 torch/distributed/launcher/api.py:136-143, a
NUMA default); on a CUDA build that counts the devices, which starts the driver and registers
``poison_fork`` (torch/csrc/cuda/Module.cpp, ``THCPModule_getDeviceCount_wrap`` ->
``register_fork_handler_for_device_init``), so every child forked afterwards fails its first
``torch.cuda.set_device`` with "Cannot re-initialize CUDA in forked subprocess", while the agent's
``torch.cuda.is_initialized()`` stays False. Measured on an H100 with torch 2.11; the same code is in
2.13 and 2.14. The CUDA runtime does not support fork at all once initialized (PyTorch's notes,
"CUDA in multiprocessing"), and Neuron's runtime is no different.

Python's forkserver (``multiprocessing``, start method ``forkserver``, which torch's elastic agent
takes for a function entrypoint: ``start_processes`` -> ``MultiprocessContext``) is a fresh
interpreter, exec'd before the agent's first worker, that imports :data:`PRELOAD` once and forks every
worker of the node from there: the workers start warm, as forked ones did (torch, ``torch._dynamo``
and the trainer already imported), and the device is untouched in the server, whatever the agent did.
``spawn`` would import everything again in every worker of every restart (docs/performance.md,
"Worker start"). The server lives as long as the agent, and a stop sent to the agent's whole process
group does not end it before the workers have checkpointed (training/launcher/worker_server.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import time
from typing import Callable

from training.contract import WARM_START_METHOD

log = logging.getLogger("training.launcher")
START_METHOD = WARM_START_METHOD  # the launch command's --start-method for the packaged trainer: one name, one place
# The server's imports (training/launcher/worker_server.py, which imports the trainer).
PRELOAD = ["training.launcher.worker_server"]
# Signals the server blocks and each worker unblocks (see worker_server): the agent's stop signals.
SERVER_BLOCKED_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


def _context():
    return multiprocessing.get_context(START_METHOD)


class WorkerServerError(RuntimeError):
    """The node's worker server could not import the trainer (its log has the error)."""


# The readiness probe's exit status when the server lacks PRELOAD (any other status: the server is up).
PRELOAD_MISSING = 3


def _ready() -> None:
    """Started once the server has imported PRELOAD, which it does silently, whatever fails (CPython's
    multiprocessing/forkserver.py, ``main``: ``except ImportError: pass``): says whether it has."""
    if PRELOAD[0] not in sys.modules:
        os._exit(PRELOAD_MISSING)


def start_server(meanwhile: Callable[[], None] = lambda: None) -> float:
    """Start this node's forkserver with the trainer imported; returns the seconds it took.

    Called before the node counts as ready to join (the rendezvous' warm-up) and after the agent's
    environment is final: a worker's environment is the server's, plus the ranks torch gives it.
    ``meanwhile`` runs in the agent while the server imports.
    """
    started = time.monotonic()
    context = _context()
    context.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()  # the server starts importing; this returns at once
    meanwhile()
    probe = context.Process(target=_ready, name="platform-forkserver-ready")
    probe.start()  # the server forks it only after its imports
    probe.join()
    if probe.exitcode == PRELOAD_MISSING:
        raise WorkerServerError(f"the worker server could not import {PRELOAD[0]}: "
                                f"run `python -c 'import {PRELOAD[0]}'` in the image to see why")
    return time.monotonic() - started


def train_worker(*argv: str) -> None:
    """A worker's entry point (torch's elastic agent runs it in a process the forkserver forked)."""
    from training.loop.worker_guard import die_with_agent

    die_with_agent()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SERVER_BLOCKED_SIGNALS)  # blocked in the server: see worker_server
    # A process the forkserver started takes forkserver as its own default start method (CPython's
    # multiprocessing/spawn.py, ``prepare``): the trainer's DataLoader workers would come from the
    # server, without the dataset the trainer built, nor its handling of stop signals
    # (training/loop/signals.py, _leave_stops_to_the_parent). They start as in any interpreter.
    multiprocessing.set_start_method(None, force=True)
    from training.__main__ import main as trainer_main
    from training.loop import signals

    try:
        code = trainer_main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported here, then the process ends at once
        # A failed collective (a peer died) leaves gloo's threads waiting on the dead peer: the
        # interpreter's teardown would wait seconds for them, and the agent for the process
        # before it can re-form the round. The traceback is printed, and the exit is immediate.
        import traceback

        traceback.print_exc()
        code = 1
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if signals.received_signal():
        # The agent is stopping the group (it sent the signal) and reads no result; torch's
        # process wrapper would wait for it to read one, until the agent's SIGKILL.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
