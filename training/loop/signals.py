"""A worker's signals: a stop (SIGTERM, Ctrl-C) checkpoints at the next step boundary, the agent's
regroup and lost-peer signals, and the watcher thread that acts on them while the main thread is
blocked in C++ (a collective, ``init_process_group``)."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
from typing import Callable

from training.contract import CONTROL_DIR_ENV, LOST_PEER_SIGNAL, REGROUP_SIGNAL, STACKS_SIGNAL

log = logging.getLogger(__name__)


_received_signal: str | None = None


def received_signal() -> str | None:
    """The stop signal this process received, if any (the launcher's forked workers ask)."""
    return _received_signal


class StopRequest:
    """Set by SIGTERM (spot interruption, eviction, torchrun restarting or stopping its workers);
    read between steps, where the trainer checkpoints and stops.

    Before the training loop has started there is nothing to save, but the main thread may be
    blocked in C++ (waiting in ``init_process_group`` for a peer that died), where Python runs
    no signal handler until the call returns: the agent would wait its whole stop budget, then
    SIGKILL. So the signal is also written to a wake-up pipe (``signal.set_wakeup_fd``, written
    by the C-level handler in whatever thread), and a watcher thread exits the process at once
    when it arrives before training started.
    """

    STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._event = threading.Event()
        self._signalled = False  # what the handler checks (see _handle)
        self._pid = os.getpid()
        self.signal_name: str | None = None
        self.training = False  # set when the training loop starts: from then on, stops checkpoint
        # The agent's REGROUP_SIGNAL: stop at a step boundary with a checkpoint, then join the next
        # round in this process (see :func:`training.loop.regroup.await_membership`) instead of exiting.
        self.regroup = False

    def install(self) -> None:
        global _current_request
        for sig in self.STOP_SIGNALS:
            signal.signal(sig, self._handle)
        # A trainer in a process forked from another trainer's (tests do that) takes its own signals.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.STOP_SIGNALS)
        if os.environ.get(CONTROL_DIR_ENV):
            signal.signal(REGROUP_SIGNAL, self._handle_regroup)
            faulthandler.register(STACKS_SIGNAL, all_threads=True)  # the agent asks where a stuck worker is
        _current_request = self
        if _watcher_pipe is None:  # one watcher per process, for whichever request is current
            _start_watcher()
            os.register_at_fork(after_in_child=_leave_stops_to_the_parent)

    def _handle(self, signum, _frame) -> None:
        global _received_signal
        if os.getpid() != self._pid:
            return  # inherited by a forked process: stops are the trainer's (_leave_stops_to_the_parent)
        ctrl_c = signum == signal.SIGINT and self.training
        if self._signalled:
            # Ctrl-C in a terminal: the first checkpoints and stops, a second one exits at once.
            # Under an agent, the terminal's Ctrl-C reaches the agent too, which forwards it to its
            # workers (torch 2.13 elastic/agent/server/api.py, ``run``: ``_shutdown(e.sigval)``): a
            # second one here is that copy. The user's second Ctrl-C ends the agent, and this
            # worker with it (worker_guard.die_with_agent). Any other repeat: already stopping.
            if ctrl_c and "TORCHELASTIC_RUN_ID" not in os.environ:
                _tell_the_terminal("second Ctrl-C: exiting now, without a checkpoint")
                os._exit(128 + signum)
            return
        # A plain attribute, stored before anything else: Python runs this handler again for a
        # signal that arrives while it runs (the agent's copy of a Ctrl-C comes milliseconds after
        # the terminal's). Checked on the Event, set after the message, the copy printed it twice
        # (and could re-enter Event.set, which holds a lock).
        self._signalled = True
        self.signal_name = _received_signal = signal.Signals(signum).name
        self._event.set()
        if ctrl_c:
            _tell_the_terminal("Ctrl-C: saving a checkpoint at the end of this step, then stopping "
                               "(Ctrl-C again exits at once)")

    def _handle_regroup(self, _signum, _frame) -> None:
        self.regroup = True

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def reset(self) -> None:
        """A new round in this process: nothing requested yet, not training yet."""
        self.regroup = False
        self.training = False


def _tell_the_terminal(line: str) -> None:
    """From a signal handler (os.write: print could re-enter a write in progress); rank 0 only."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"{line}\n".encode())


_current_request: StopRequest | None = None
_watcher_pipe: tuple[int, int] | None = None
_on_lost_peer: Callable[[], None] | None = None  # see on_lost_peer


def _start_watcher() -> None:
    global _watcher_pipe
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    _watcher_pipe = (read_end, write_end)
    threading.Thread(target=_watch, args=(read_end,), name="stop-before-training", daemon=True).start()


def _watch(read_end: int) -> None:
    while True:
        received = os.read(read_end, 64)
        if not received:
            return
        if LOST_PEER_SIGNAL in received and _on_lost_peer is not None:
            try:  # the main thread may be blocked in a collective on the dead peer: end it now
                _on_lost_peer()
            except Exception:
                log.exception("acting on the lost peer failed")
        stops = [number for number in received if number in StopRequest.STOP_SIGNALS]
        request = _current_request
        if stops and request is not None and not request.training:
            log.warning("%s before training started: nothing to checkpoint, exiting now",
                        signal.Signals(stops[0]).name)
            os._exit(128 + stops[0])


def _leave_stops_to_the_parent() -> None:
    """In a process the trainer forks (its DataLoader workers): a stop signal is the trainer's to act on.

    Ctrl-C, ``kill -- -PGID``, systemd and Slurm signal every process of the group or unit, the
    loader workers too. A worker that inherited the trainer's handler would say "Ctrl-C: saving a
    checkpoint" once per worker; and torch's own SIGTERM handler in a worker (installed by
    ``_worker_loop``, torch/utils/data/_utils/worker.py, torch 2.13.0) dies by the signal unless
    it came from the parent (``handler_SIGTERM``, torch/csrc/DataLoader.cpp), after which the
    trainer's SIGCHLD handler raises "DataLoader worker ... is killed by signal: Terminated" in
    the middle of the step it was to checkpoint at the end of. So here SIGINT is ignored and
    SIGTERM is blocked before torch installs anything (this runs at the fork), and a thread takes
    SIGTERMs as they come: the parent's (``w.terminate()`` when shutting its workers down) ends
    the worker at once as torch's handler would, any other sender's is dropped. The worker then
    ends when the trainer shuts its loader down, or when the trainer is gone (the worker loop's
    ``ManagerWatchdog``). Loaders use the default start method, fork on Linux (a spawned or
    forkserver worker would not run this).
    """
    request = _current_request
    parent = os.getppid()
    if request is None or request._pid != parent:
        return  # forked by a process other than the trainer that installed the request
    signal.set_wakeup_fd(-1)  # the pipe is the parent's watcher's: this process's signals are not its news
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_end_on_sigterm_from, args=(parent,), name="sigterm-from-parent", daemon=True).start()


def _end_on_sigterm_from(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)


def on_lost_peer(callback: Callable[[], None]) -> None:
    """Run ``callback`` on the watcher thread when the agent reports a lost peer (LOST_PEER_SIGNAL),
    while the main thread may be blocked in a collective on the dead peer. The signal's handler itself
    does nothing: its number reaches the watcher through the wake-up pipe (see _watch)."""
    global _on_lost_peer
    signal.signal(LOST_PEER_SIGNAL, lambda _signum, _frame: None)
    _on_lost_peer = callback
