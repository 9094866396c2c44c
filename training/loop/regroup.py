"""The regroup, on the worker's side: its place in a rendezvous round, the handshake with its agent when
the round changes in place (training/launcher/agent.py is the other side; the files' names are the
contract's, ``control_file``), leaving a broken group and joining the next.

The trainer drives it (``Trainer.regroup``, ``Trainer.rejoin`` in training/loop/trainer.py); a step
in flight when a peer died is told apart in training/loop/lost_peer.py.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from training.contract import (
    BROKEN_MARKER, CONTROL_DIR_ENV, MEMBERSHIP_FILE, PAUSED_FILE, RECOVERS_MARKER, REGROUP_IN_PLACE_ENV, control_file,
)
from training.loop import signals
from training.loop.signals import StopRequest

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
    signals.on_lost_peer(on_lost_peer)
    (Path(os.environ[CONTROL_DIR_ENV]) / control_file(RECOVERS_MARKER, os.environ.get("LOCAL_RANK", "0"))).touch()
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
    marker = directory / control_file(BROKEN_MARKER, local_rank)
    if broken is not None:
        _write_atomically(marker, f"{generation} {type(broken).__name__}: {first_line(broken)[:300]}")
    _write_atomically(directory / control_file(PAUSED_FILE, local_rank), str(generation))
    wanted = directory / control_file(MEMBERSHIP_FILE, local_rank)
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
