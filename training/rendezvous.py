"""The platform's rendezvous: torch's dynamic rendezvous on etcd (v2 API), made to outlive etcd.

torch 2.13's agents poll ``num_nodes_waiting()`` between worker health checks and exit on the
first ``RendezvousConnectionError`` (torch/distributed/elastic/agent/server/api.py
``_invoke_run``), so a few seconds without etcd ended every running job, and the dying agents
closed the rendezvous (launcher/api.py ``launch_agent``: ``shutdown()`` in ``finally``). This
handler (registered by :mod:`training.launch` as ``platform-etcd``) differs from
``etcd-v2`` in four ways and in nothing else:

- **Outages are waited out.** While etcd is unreachable, ``num_nodes_waiting()`` answers 0
  (nobody can be waiting on a store nobody can reach) and ``next_rendezvous()`` retries, for
  up to ``outage_tolerance`` seconds; only beyond that does the error reach the agent.
- **Missed heartbeats are not deaths.** Heartbeats missed during an outage would make every
  node look dead to the first node that reads the state afterwards. A node is declared dead
  only if etcd answered promptly for a whole expiry and the node did not heartbeat: the clock
  restarts at every failed request, or one slower than a heartbeat interval (etcd restarting).
- **A node that lost its place rejoins.** If the state no longer lists this node in the
  round it joined (etcd came back empty, or a peer declared it dead), it reports a waiting
  node, so its agent re-rendezvouses with everyone (its workers checkpoint on the way out)
  instead of training on beside a second world.
- **A dead peer restarts the round.** torch removes a node whose heartbeats stopped from the
  participants (``_sanitize``) but leaves the round complete, so the survivors' agents notice
  only when their workers fail: at once in a gloo collective, after the collective timeout
  with NCCL, after the TCPStore connect timeout (minutes) while workers start. Here a node
  that sees a member of its round gone reports a waiting node, and its agent restarts the
  workers into a new round about one heartbeat expiry (1.5 s) after the death; like any
  membership change, that does not count against ``--max-restarts``.
- **Only success closes the round.** ``shutdown()`` leaves the round open; the launcher
  closes it after the job finished. A failed agent therefore never strands its peers or the
  pod that replaces it.

Keep-alive intervals and timeouts may be fractions of a second (torch's parser takes whole
seconds), and a waiting rendezvous polls etcd ten times a second instead of once: that is what
makes recovery from a lost node fast.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import fields, replace
from datetime import datetime, timedelta, timezone

import etcd  # python-etcd, which torch's etcd-v2 backend uses
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler, RendezvousSettings, RendezvousTimeout, _BackendRendezvousStateHolder,
    _RendezvousKeepAliveOp,
)
from torch.distributed.elastic.rendezvous.registry import handler_registry

from training.launch import RendezvousTuning

log = logging.getLogger(__name__)
BACKEND_NAME = "platform-etcd"
CLOSE_TIMEOUT_S = 30
# The handlers this process created; the launcher closes their round after success.
CREATED: list["PlatformRendezvousHandler"] = []


class Outage:
    """When etcd stopped answering, and since when it has answered promptly again."""

    def __init__(self, tolerance_s: float, slow_s: float) -> None:
        self.tolerance_s = tolerance_s
        self.slow_s = slow_s
        self.since: float | None = None
        # Wall-clock time from which every request has been answered within slow_s.
        self.healthy_since = datetime.now(timezone.utc)
        self._lock = threading.Lock()

    def failed(self) -> None:
        with self._lock:
            self.healthy_since = datetime.now(timezone.utc)
            if self.since is None:
                self.since = time.monotonic()
                log.warning("etcd is unreachable; the job keeps training and waits up to %.0f s for it",
                            self.tolerance_s)

    def answered(self, seconds: float) -> None:
        with self._lock:
            if seconds > self.slow_s:
                self.healthy_since = datetime.now(timezone.utc)
            if self.since is not None:
                log.warning("etcd answers again after %.1f s", time.monotonic() - self.since)
                self.since = None

    @property
    def exceeded(self) -> bool:
        return self.since is not None and time.monotonic() - self.since > self.tolerance_s


class _ToleratingStateHolder(_BackendRendezvousStateHolder):
    """The backend state, without declaring nodes dead for heartbeats etcd could not take.

    torch declares a node dead when its last heartbeat is older than the expiry. Here the
    clock starts no earlier than the moment etcd last became promptly available to this node:
    a node is dead only if etcd was there for a whole expiry and it did not heartbeat.
    """

    def __init__(self, backend, settings: RendezvousSettings, outage: Outage) -> None:
        super().__init__(backend, settings)
        self._outage = outage
        self._sync_started = time.monotonic()

    def sync(self):
        self._sync_started = time.monotonic()
        try:
            result = super().sync()
        except RendezvousConnectionError as exc:
            if isinstance(exc.__cause__, etcd.EtcdKeyNotFound):
                # A write against a state etcd no longer has (it restarted empty): torch's backend
                # reports it as a connection error on every heartbeat. Start from no state instead.
                log.warning("etcd lost the rendezvous state; starting from an empty one")
                self._token, self._dirty, self._last_sync_time = None, False, -1
                return super().sync()
            self._outage.failed()
            raise
        self._outage.answered(time.monotonic() - self._sync_started)
        return result

    def _sanitize(self) -> None:
        # A heartbeat older than the start of etcd's current availability counts from that start
        # (the bump may be written back with the state; a dead node is still found one expiry later).
        # A request that is itself slow (etcd restarting) starts that availability now.
        floor = self._outage.healthy_since
        if time.monotonic() - self._sync_started > self._outage.slow_s:
            floor = datetime.now(timezone.utc)
        heartbeats = self._state.last_heartbeats
        for node, last in list(heartbeats.items()):
            if last < floor:
                heartbeats[node] = floor
        super()._sanitize()


def tuning_from_params(params: RendezvousParameters) -> RendezvousTuning:
    """The ``--rdzv-conf`` keys of :class:`RendezvousTuning`, fractions of a second allowed."""
    defaults = RendezvousTuning()
    values = {}
    for field in fields(RendezvousTuning):
        raw = params.get(field.name)
        if raw is not None:
            values[field.name] = type(getattr(defaults, field.name))(float(raw))
    return replace(defaults, **values)


class PlatformRendezvousHandler(DynamicRendezvousHandler):
    """See the module docstring."""

    @classmethod
    def create(cls, params: RendezvousParameters) -> "PlatformRendezvousHandler":
        from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

        tuning = tuning_from_params(params)
        backend, store = create_backend(params)
        settings = RendezvousSettings(
            params.run_id, params.min_nodes, params.max_nodes,
            RendezvousTimeout(join=timedelta(seconds=tuning.join_timeout),
                              last_call=timedelta(seconds=tuning.last_call_timeout),
                              close=timedelta(seconds=CLOSE_TIMEOUT_S),
                              heartbeat=timedelta(seconds=tuning.read_timeout)),
            keep_alive_interval=timedelta(seconds=tuning.keep_alive_interval),
            keep_alive_max_attempt=tuning.keep_alive_max_attempt,
        )
        # A request slower than one heartbeat interval (etcd restarting, a leader change) may
        # have delayed everyone's heartbeats: it restarts the clock like a failed one.
        outage = Outage(tuning.outage_tolerance, slow_s=tuning.keep_alive_interval)
        handler = cls(cls._node_desc_generator.generate(params.local_addr), settings, BACKEND_NAME, store,
                      _ToleratingStateHolder(backend, settings, outage))
        handler._outage = outage
        handler._joined_round = None
        handler._joined_members = set()
        handler._close_on_shutdown = False
        CREATED.append(handler)
        return handler

    def next_rendezvous(self):
        delay = 0.2
        while True:
            try:
                info = super().next_rendezvous()
            except RendezvousConnectionError:
                if self._outage.exceeded:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            self._joined_round = self._state_holder.state.round
            self._joined_members = set(self._state_holder.state.participants)
            return info

    def num_nodes_waiting(self) -> int:
        try:
            waiting = super().num_nodes_waiting()
        except RendezvousConnectionError:
            if self._outage.exceeded:
                raise
            return 0
        if self._joined_round is not None and not self._still_in_my_round():
            log.warning("this node is no longer in round %s of the rendezvous (etcd lost its state, or a peer "
                        "declared it dead); re-joining", self._joined_round)
            self._joined_round = None
            return 1
        gone = self._joined_members - set(self._state_holder.state.participants) if self._joined_round is not None \
            else set()
        if gone:
            log.warning("%d node(s) of round %s stopped heartbeating; restarting this node's workers into a new "
                        "round", len(gone), self._joined_round)
            self._joined_round = None
            return 1
        return waiting

    def _still_in_my_round(self) -> bool:
        state = self._state_holder.state
        return state.round == self._joined_round and self._this_node in state.participants

    def _keep_alive(self) -> None:
        # torch's keep-alive logs a warning on every failed heartbeat; during an outage that is
        # several lines a second, and the outage itself is logged once.
        with self._heartbeat_lock:
            try:
                self._op_executor.run(_RendezvousKeepAliveOp(), self._get_deadline(self._settings.timeout.heartbeat))
            except RendezvousConnectionError:
                pass

    def shutdown(self) -> bool:
        self._stop_heartbeats()
        if self._close_on_shutdown:
            return super().shutdown()
        return True

    def close_round(self) -> None:
        """Close the round for good: the job finished. Later agents of this run id exit at once."""
        self._close_on_shutdown = True
        self.set_closed()


# While a rendezvous waits for others (the last call, a dead node's expiry), torch polls the
# state once a second (dynamic_rendezvous.py, _DistributedRendezvousOpExecutor.run, SYNC), which
# adds up to a second to every recovery; the platform polls ten times a second.
SYNC_POLL_S = 0.1
_torch_delay = dynamic_rendezvous._delay


def _platform_delay(seconds) -> None:
    if isinstance(seconds, tuple):  # the random skew before a first round
        _torch_delay(seconds)
    else:
        _torch_delay(min(seconds, SYNC_POLL_S))


def register() -> None:
    """Make ``--rdzv-backend platform-etcd`` available to torch's agent in this process."""
    dynamic_rendezvous._delay = _platform_delay
    try:
        handler_registry.register(BACKEND_NAME, PlatformRendezvousHandler.create)
    except ValueError:
        pass  # registered already
