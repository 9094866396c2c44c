"""What a worker under torchrun needs to survive elasticity: membership, timeouts, signals, its agent."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from training.contract import (  # IMDS_ENDPOINT_ENV and SPOT_NOTICE_ENV: the names callers use, as elastic.NAME
    BROKEN_MARKER, CONTROL_DIR_ENV, IMDS_ENDPOINT_ENV, LOST_PEER_SIGNAL, MEMBERSHIP_FILE, PAUSED_FILE, RECOVERS_MARKER,
    REGROUP_IN_PLACE_ENV, REGROUP_SIGNAL, SPOT_NOTICE_ENV as SPOT_NOTICE_ENV, STACKS_SIGNAL,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Membership:
    """This worker's place in the current rendezvous round; it changes on every restart."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    restart_count: int
    run_id: str

    @classmethod
    def from_environment(cls) -> "Membership":
        env = os.environ
        return cls(
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            node_rank=int(env.get("GROUP_RANK", "0")),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            run_id=env.get("TORCHELASTIC_RUN_ID", "local"),
        )

    @property
    def distributed(self) -> bool:
        return "MASTER_ADDR" in os.environ  # set by torchrun, even for a single worker


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
        # round in this process (see :func:`await_membership`) instead of exiting.
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


# Backends whose workers keep their state through a lost peer (see RECOVERS_MARKER in training/contract.py,
# and training/loop/lost_peer.py for how a step cut short is told apart).
RECOVERING_BACKENDS = ("gloo", "nccl")


# What a worker that recovers sets before its NCCL group exists: the watchdog neither aborts the
# communicators itself (modes 1 and 2: the update queued after an aborted collective would run
# without the flag of training/loop/lost_peer.py) nor ends the process (modes 1 and 3, torch's
# default 3) when a collective fails or times out; lost_peer.GroupGuard breaks the group instead
# (``_abort_process_group``'s docstring asks for 0, torch 2.13 distributed_c10d.py). No debug dump
# either: it runs on the watchdog's thread while the abort waits (the first H100 try, 2026-11-27).
RECOVERING_NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


def regroups_in_place() -> bool:
    """Whether this worker's agent moves it between rounds in place (training/launcher/agent.py)."""
    return bool(os.environ.get(CONTROL_DIR_ENV)) and os.environ.get(REGROUP_IN_PLACE_ENV, "1") != "0"


def recovers_from_lost_peers(backend: str, on_lost_peer: Callable[[], None]) -> bool:
    """Whether this worker keeps its state through a lost peer, and tells its agent so (it then
    waits for the worker to pause instead of restarting it). ``on_lost_peer`` runs on the watcher
    thread when the agent reports one (LOST_PEER_SIGNAL), while the main thread may be blocked in
    a collective on the dead peer. Call before the process group exists: an NCCL worker's
    watchdog must leave failures to it (RECOVERING_NCCL_ENVIRONMENT)."""
    if not regroups_in_place() or backend not in RECOVERING_BACKENDS:
        return False
    if backend == "nccl":
        os.environ.update(RECOVERING_NCCL_ENVIRONMENT)
    # The handler itself does nothing: the signal's number reaches the watcher thread through the
    # wake-up pipe (see _watch), which runs while the main thread is blocked in a collective.
    signal.signal(LOST_PEER_SIGNAL, lambda _signum, _frame: None)
    global _on_lost_peer
    _on_lost_peer = on_lost_peer
    local_rank = os.environ.get("LOCAL_RANK", "0")
    (Path(os.environ[CONTROL_DIR_ENV]) / f"{RECOVERS_MARKER}-{local_rank}").touch()
    return True


def await_membership(local_rank: int, generation: int, stop: StopRequest,
                     broken: BaseException | None = None) -> dict[str, str] | None:
    """Between rounds, in a worker that regroups: tell the agent this worker has left the old
    group (``broken``: because a collective failed under it), then wait for its place in the next
    round (the environment torchrun would start a worker with). None: the agent found no lost peer
    to re-form without, so the failure was this job's own. A stop signal meanwhile (the agent gave
    up regrouping) ends the process."""
    import json

    directory = Path(os.environ[CONTROL_DIR_ENV])
    marker = directory / f"{BROKEN_MARKER}-{local_rank}"
    if broken is not None:
        _write_atomically(marker, f"{generation} {type(broken).__name__}: {first_line(broken)[:300]}")
    _write_atomically(directory / f"{PAUSED_FILE}-{local_rank}", str(generation))
    wanted = directory / f"{MEMBERSHIP_FILE}-{local_rank}.json"
    try:
        while not stop.requested:
            try:
                found = json.loads(wanted.read_text())
            except (OSError, ValueError):
                found = None
            if found and found["generation"] >= generation:
                return found["env"]
            time.sleep(0.02)
    finally:
        marker.unlink(missing_ok=True)
    raise SystemExit(128 + signal.Signals[stop.signal_name or "SIGTERM"].value)


def first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]


def leave_process_group() -> Any:
    """Drop this round's process group, also when a peer is dead: abort, where torch has it for
    the backend, returns at once and never waits on the dead peer (torch 2.13
    torch/distributed/distributed_c10d.py ``_abort_process_group``; ``destroy_process_group`` shuts
    backends down, which NCCL may block in, pytorch issue 119797). A group that broke under this
    worker was ended first (training/loop/lost_peer.py, GroupGuard.break_group).

    Returns the group left, which the caller keeps a while (:class:`RetiredGroups`): its last
    reference must not go while its threads may still be finishing work."""
    if not dist.is_initialized():
        return None
    group = dist.distributed_c10d._get_default_group()
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # in 2.8, 2.13 and 2.14.1
    if abort is not None:
        try:
            abort()
            return group
        except RuntimeError as exc:
            log.debug("abort failed (%s); destroying the process group", exc)
    if dist.is_initialized():
        dist.destroy_process_group()
    return group


class RetiredGroups:
    """Process groups this worker left, kept alive for RETIRED_GROUP_S before their last reference goes.

    gloo's group joins its worker threads when it is destroyed (torch 2.13 ProcessGroupGloo's
    destructor: ``thread.join()``), and that happens where its last reference goes: with the old
    DDP wrapper (its Reducer holds the group), on the main thread, which holds the GIL. A worker
    thread still finishing a collective of the broken round frees the work's tensors, which needs
    the GIL (``c10::TensorImpl::decref_pyobject``): each waits for the other, for good. Seen with
    py-spy in a stress of lost peers then admissions (2026-11-28): the worker never paused for the
    next regroup and ignored SIGTERM; the CI failures of the in-place scale-up and batching drills.
    Kept a while, the group's threads are idle when it goes, and its destructor joins them at once.
    """

    def __init__(self, keep_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s = keep_s
        self._clock = clock
        self._groups: list[tuple[float, Any]] = []

    def retire(self, group: Any) -> None:
        """Keep ``group``; let go of the ones kept longer than ``keep_s``."""
        now = self._clock()
        self._groups = [(at, kept) for at, kept in self._groups if now - at < self.keep_s]
        if group is not None:
            self._groups.append((now, group))


def shut_tcp_connections() -> int:
    """Shut down (both ways) every connected TCP socket this process holds; how many.

    The worker's connections are its process group's (gloo's pairs, the round's store client):
    all of the round that just broke. The descriptors stay open for their owners, which see the
    connection end. Found from this process's own descriptors, not from /proc/net/tcp: that table
    lists every socket of the network namespace: with 16 agents on a 2-core machine a worker took up
    to 1.2 s from breaking its group to shutting its 3 connections, 25 ms at most this way
    (benchmarks/elastic_recovery.py --lost-node 16, 2026-11-27). A listener is left alone: gloo's
    ends the process when its accept fails (gloo/transport/tcp/listener.cc, "accept: Invalid
    argument"). Each copy is checked to be the socket listed (a descriptor closed and reused
    meanwhile is left alone).
    """
    import socket

    shut = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith("socket:["):
            continue
        try:
            copy = os.dup(int(name))
        except OSError:
            continue  # closed by its owner meanwhile
        try:
            if os.fstat(copy).st_ino != int(target[8:-1]):
                continue
            connection = socket.socket(fileno=copy)  # its family and type read from the descriptor
            try:
                if (connection.family in (socket.AF_INET, socket.AF_INET6) and connection.type == socket.SOCK_STREAM
                        and not connection.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                    connection.shutdown(socket.SHUT_RDWR)
                    shut += 1
            finally:
                connection.detach()  # the copy is closed below, once
        except OSError:
            pass  # not connected (any more)
        finally:
            os.close(copy)
    return shut


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def _tell_the_terminal(line: str) -> None:
    """From a signal handler (os.write: print could re-enter a write in progress); rank 0 only."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"{line}\n".encode())


_current_request: StopRequest | None = None
_watcher_pipe: tuple[int, int] | None = None
_on_lost_peer: Callable[[], None] | None = None  # see recovers_from_lost_peers


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


def init_process_group(backend: str, membership: Membership, device: torch.device, timeout_s: int) -> None:
    """Join the process group of this rendezvous round with an explicit timeout."""
    if not membership.distributed or dist.is_initialized():
        return
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)


def shorten_timeout(seconds: int) -> None:
    """After warm-up, a peer that stops answering must fail the step in seconds, not 30 minutes.

    torch has no public setter for an existing group's timeout; ``_set_pg_timeout`` is the one
    torch itself uses and tests (gloo and nccl).
    """
    if dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def any_rank(*flags: bool | torch.Tensor, device: torch.device) -> tuple[bool, ...]:
    """Each flag true on every rank when it is true on any rank: one tiny all-reduce for all of them.

    A flag may be a tensor on ``device`` (a loss that is not finite, say): it is read only
    through the all-reduce, so it adds no host sync of its own. Without a process group the
    flags come back as they are (tensors unread).
    """
    if not dist.is_initialized():
        return flags
    value = _flag_tensor(flags, device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return tuple(bool(v > 0) for v in value.tolist())


def _flag_tensor(flags: tuple[bool | torch.Tensor, ...], device: torch.device) -> torch.Tensor:
    """The flags as one float tensor on ``device``; tensor flags are copied in without a host read."""
    value = torch.tensor([float(f) if isinstance(f, bool) else 0.0 for f in flags], device=device)
    for i, flag in enumerate(flags):
        if isinstance(flag, torch.Tensor):
            value[i] = flag.to(device=device, dtype=value.dtype).reshape(())
    return value


@dataclass
class FlagBuffers:
    """One step's flags on their way: written on the host (``send``), all-reduced in ``reduce`` on
    the device, copied back into ``receive``; ``event`` marks the copy back (None on the host)."""

    send: torch.Tensor
    reduce: torch.Tensor
    receive: torch.Tensor
    event: Any = None


class HostFlags:
    """The flags of a group that reduces in host memory (gloo): one tensor is written, reduced and
    read. Its all-reduce runs on gloo's threads; waiting for it is what ``read_when_ready`` does,
    a step later, once the peers had a step's time to send theirs."""

    def buffers(self, count: int) -> FlagBuffers:
        value = torch.zeros(count)
        return FlagBuffers(send=value, reduce=value, receive=value)

    def to_device(self, buffers: FlagBuffers) -> None:
        """Nothing to copy: ``send`` is ``reduce``."""

    def after_reduce(self, work: Any, buffers: FlagBuffers) -> Any:
        return work

    def read_when_ready(self, work: Any, buffers: FlagBuffers) -> list[float]:
        work.wait()
        return buffers.receive.tolist()


class DeviceFlags:
    """The flags of a group that reduces on a CUDA device (NCCL), without a host synchronization.

    ``torch.tensor(list, device="cuda")`` and ``.tolist()`` of a device tensor both make the host
    wait until the device has run everything queued before them: a copy between host and device
    without ``non_blocking`` ends in ``at::cuda::memcpy_and_sync`` (torch 2.13
    aten/src/ATen/native/cuda/Copy.cu ``copy_kernel_cuda``; torch/csrc/utils/tensor_new.cpp
    builds ``torch.tensor`` on the host, then ``.to(device, non_blocking=false)``; pytorch issue
    120996). Instead the flags go through page-locked host buffers with ``non_blocking`` copies
    (``cudaMemcpyAsync`` in that same function; into pageable memory a copy from the device
    returns only once done: CUDA runtime API, "API synchronization behavior"), the all-reduce's
    work is joined by the current stream only (``Work.wait`` of a CUDA collective blocks the
    stream, not the host: torch docs, distributed, "Synchronous and asynchronous collective
    operations"), and an event recorded after the copy back says when ``receive`` may be read.
    It is read a step later, when the device has normally long passed it: ``query`` says so
    without waiting; only a host that runs more than a step ahead waits on the event
    (``cudaEventSynchronize``), for that step alone.

    ``pin`` and ``event`` let a test stand a CPU in for the device.
    """

    def __init__(self, device: torch.device, pin: bool = True, event: Any = None) -> None:
        self.device = device
        self.pin = pin
        self.event = event or torch.cuda.Event

    def buffers(self, count: int) -> FlagBuffers:
        return FlagBuffers(send=torch.zeros(count, pin_memory=self.pin),
                           reduce=torch.zeros(count, device=self.device),
                           receive=torch.zeros(count, pin_memory=self.pin), event=self.event())

    def to_device(self, buffers: FlagBuffers) -> None:
        buffers.reduce.copy_(buffers.send, non_blocking=True)

    def after_reduce(self, work: Any, buffers: FlagBuffers) -> Any:
        # The current stream waits for the all-reduce; the host goes on (it would wait with
        # TORCH_NCCL_BLOCKING_WAIT=1, which the platform does not set).
        work.wait()
        buffers.receive.copy_(buffers.reduce, non_blocking=True)
        buffers.event.record()
        return buffers.event

    def read_when_ready(self, event: Any, buffers: FlagBuffers) -> list[float]:
        if not event.query():
            event.synchronize()
        return buffers.receive.tolist()


class LazyFlags:
    """The flags of the ``xla`` group, whose all-reduce is an op of the XLA graph on a device tensor
    (torch_xla 2.8.0 torch_xla/distributed/xla_backend.py, ProcessGroupXla.allreduce: ``xm.all_reduce``).
    Nothing runs when it is called: the step's ``mark_step`` runs it with the step's graph, and
    reading ``reduce`` a step later finds it done; read before that, XLA runs it then."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def buffers(self, count: int) -> FlagBuffers:
        value = torch.zeros(count, device=self.device)
        return FlagBuffers(send=torch.zeros(count), reduce=value, receive=value)

    def to_device(self, buffers: FlagBuffers) -> None:
        buffers.reduce.copy_(buffers.send)

    def after_reduce(self, work: Any, buffers: FlagBuffers) -> Any:
        return work

    def read_when_ready(self, work: Any, buffers: FlagBuffers) -> list[float]:
        work.wait()
        return buffers.receive.tolist()


def flag_transport(device: torch.device) -> HostFlags | DeviceFlags | LazyFlags:
    """How the agreement's flags reach a group that reduces on ``device``."""
    if device.type == "cuda":
        return DeviceFlags(device)
    return LazyFlags(device) if device.type == "xla" else HostFlags()


class LaggedAgreement:
    """:func:`any_rank` without the host sync: a step's flags go out as an asynchronous all-reduce,
    and are read at the next step, once that step's work is queued.

    A synchronous agreement makes the host wait each step for the device to finish it, so the
    next step's launches start on an idle GPU. Read a step later, the all-reduce has long
    finished while the device works on the step after; the price is that every rank acts on a
    flag one step after it was raised, all at the same step.

    Two sets of buffers take turns (``transport`` says how the flags travel, see
    :class:`DeviceFlags`): a step's are written again two steps later, after the step between
    has read them, so a copy still queued never reads a buffer the host is rewriting.
    """

    def __init__(self, device: torch.device, transport: HostFlags | DeviceFlags | LazyFlags | None = None) -> None:
        self.device = device
        self.transport = transport or flag_transport(device)
        self._buffers: list[FlagBuffers] = []
        self._turn = 0
        self._in_flight: tuple[Any, FlagBuffers] | None = None

    def exchange(self, *flags: bool | torch.Tensor) -> tuple[bool, ...] | None:
        """Send this step's flags; the previous step's, reduced over every rank (None at the first)."""
        if not self._buffers:
            self._buffers = [self.transport.buffers(len(flags)) for _ in range(2)]
        buffers = self._buffers[self._turn]
        self._turn = 1 - self._turn
        buffers.send.copy_(torch.tensor([float(f) if isinstance(f, bool) else 0.0 for f in flags]))
        self.transport.to_device(buffers)
        for i, flag in enumerate(flags):
            if isinstance(flag, torch.Tensor):  # a device tensor (a loss that is not finite): never read here
                buffers.reduce[i] = flag.to(device=self.device, dtype=buffers.reduce.dtype).reshape(())
        work = dist.all_reduce(buffers.reduce, op=dist.ReduceOp.MAX, async_op=True)
        marker = self.transport.after_reduce(work, buffers)
        previous, self._in_flight = self._in_flight, (marker, buffers)
        if previous is None:
            return None
        return tuple(v > 0 for v in self.transport.read_when_ready(*previous))

    def settle(self) -> None:
        """Complete the all-reduce in flight (before the process group goes away); its flags are dropped."""
        if self._in_flight is not None:
            self.transport.read_when_ready(*self._in_flight)
            self._in_flight = None


class SpotNotice:
    """Watches the node's metadata for EC2's two-minute Spot interruption notice.

    ``spot/instance-action`` answers 404 until EC2 schedules the interruption, then the action
    and its time (EC2 User Guide, "Spot Instance interruption notices"); IMDSv2 needs a session
    token first. One rank per node polls; the training loop checkpoints at the next step once any
    rank has seen the notice, before the drain's SIGTERM arrives.
    """

    def __init__(self, enabled: bool, interval_s: float = 5.0) -> None:
        self._seen = threading.Event()
        self._acted = False
        self.action: str | None = None
        if enabled:
            self._endpoint = os.environ.get(IMDS_ENDPOINT_ENV, "http://169.254.169.254").rstrip("/")
            thread = threading.Thread(target=self._watch, args=(interval_s,), name="spot-notice", daemon=True)
            thread.start()

    @property
    def pending(self) -> bool:
        """Seen and not acted on yet."""
        return self._seen.is_set() and not self._acted

    def acted(self) -> None:
        self._acted = True

    def _watch(self, interval_s: float) -> None:
        import http.client
        import json
        import urllib.error
        import urllib.request

        while not self._seen.is_set():
            try:
                token_request = urllib.request.Request(f"{self._endpoint}/latest/api/token", method="PUT", headers={
                    "X-aws-ec2-metadata-token-ttl-seconds": "300"})
                token = urllib.request.urlopen(token_request, timeout=2).read().decode()
                request = urllib.request.Request(f"{self._endpoint}/latest/meta-data/spot/instance-action",
                                                 headers={"X-aws-ec2-metadata-token": token})
                self.action = json.loads(urllib.request.urlopen(request, timeout=2).read()).get("action")
                log.warning("EC2 Spot interruption notice (%s): checkpointing now, before the drain", self.action)
                self._seen.set()
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    log.debug("instance metadata answered %s", exc.code)
            except (OSError, ValueError, http.client.HTTPException):
                # No metadata service (off EC2) or a transient error (a request cut by
                # shut_tcp_connections after a lost peer, say): try again.
                pass
            time.sleep(interval_s)
