"""What a worker under torchrun needs to survive elasticity: membership, timeouts, signals, its agent."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from training.launch import IMDS_ENDPOINT_ENV, SPOT_NOTICE_ENV  # noqa: F401 - the names callers use

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


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


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its torchrun agent dies.

    torchrun starts workers in their own session, so a killed agent (OOM, a pod deleted with
    force) would leave them training as ghosts that hold the rendezvous and the GPUs.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent:  # the agent died before the request took effect
        os._exit(1)


_received_signal: str | None = None


def received_signal() -> str | None:
    """The stop signal this process received, if any (the launcher's forked workers ask)."""
    return _received_signal


class StopRequest:
    """Set by SIGTERM (spot interruption, eviction, torchrun shutting down); read between steps."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        global _received_signal
        self.signal_name = _received_signal = signal.Signals(signum).name
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()


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


def any_rank(*flags: bool, device: torch.device) -> tuple[bool, ...]:
    """Each flag true on every rank when it is true on any rank (one tiny all-reduce for all of them)."""
    if not dist.is_initialized():
        return flags
    value = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return tuple(bool(v > 0) for v in value.tolist())


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
        import json
        import urllib.error
        import urllib.request

        while not self._seen.is_set():
            try:
                token_request = urllib.request.Request(f"{self._endpoint}/latest/api/token", method="PUT", headers={
                    "X-aws-ec2-metadata-token-ttl-seconds": "300"})
                token = urllib.request.urlopen(token_request, timeout=2).read().decode()  # noqa: S310
                request = urllib.request.Request(f"{self._endpoint}/latest/meta-data/spot/instance-action",
                                                 headers={"X-aws-ec2-metadata-token": token})
                self.action = json.loads(urllib.request.urlopen(request, timeout=2).read()).get("action")  # noqa: S310
                log.warning("EC2 Spot interruption notice (%s): checkpointing now, before the drain", self.action)
                self._seen.set()
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    log.debug("instance metadata answered %s", exc.code)
            except (OSError, ValueError):
                pass  # no metadata service (off EC2) or a transient error: try again
            time.sleep(interval_s)
