"""The platform's rendezvous for torchrun, on etcd's v3 API: leases for liveness, transactions for rounds.

Registered by :mod:`training.launcher.main` as ``platform-etcd``. torch's own ``etcd-v2`` backend (and
this module's earlier form on it) keeps the whole rendezvous in one pickled key that every
agent's heartbeat rewrites by compare-and-swap, speaks the v2 API that etcd 3.6 removed, and
restarts the worker group whenever any node waits (torch 2.13 ``agent/server/api.py``
``_invoke_run``: ``num_nodes_waiting() > 0``), with one ``last_call_timeout`` for growing and
shrinking alike. Measured here with 8 and 16 agents, a job restarted for every arrival and
never reached its full size. This handler implements torch's ``RendezvousHandler`` interface
(``rendezvous/api.py``) from scratch instead:

- **Liveness is a lease.** Each agent holds one etcd lease, renewed every
  ``keep_alive_interval``, and one key ``node/<id>`` attached to it. A heartbeat renews the
  lease and writes nothing; a node that dies disappears when its lease expires
  (``lease_ttl``, raised by etcd to its minimum: 1 s with the platform's etcd flags), and
  one that stops cleanly revokes it and disappears at once.
- **Rounds change in transactions.** ``state`` holds the current round: its id, whether it is
  forming or running, its members in rank order and the rank-0 address. Only new rounds and
  completions write it, each a compare-on-revision transaction. A node joins a forming round with
  a key of its own on its lease (``join/<round>/<node>``), so joins never contend; the oldest
  joiner alive completes the round, and the others wait on a probe of a few bytes.
- **Checks read a probe, not the world.** A running agent's check and a waiting agent's poll first
  read a few bytes (the state's revision, how many nodes are live, the newest write to a node's key)
  and read every node's key again only when they changed: while a job trains, etcd sends each agent the same
  few bytes whatever the node count. Above ``STRETCH_ABOVE_NODES`` nodes each agent calls etcd less
  often, in proportion (``Rates``), so that etcd's load stays about that of a job of that size.
- **Shrink has no last call.** A round re-forming after a loss completes as soon as every
  live member of the previous round has re-joined; a dead member is known by its missing key.
- **Growth is batched.** A node that arrives while a round is running waits; the running
  members admit all waiting nodes together, once the round has trained for
  ``scale_up_after_s`` since it started (its first progress report, see
  :data:`training.launcher.main.PROGRESS_FILE_ENV`); that round completes once every live node has
  joined. Only a job's first round waits ``last_call_timeout`` for nodes starting together.
  Below ``min_nodes`` nothing waits.
- **Newcomers count only when ready.** An agent registers as waiting after its warm-up
  (``training.launcher.main`` starts the node's worker server, which imports torch._dynamo and the
  trainer, before that, so the workers it forks start warm). On an admission the survivors' workers stay up and join the new
  round in place (``training/launcher/agent.py``, ``_regroup``).
- **etcd outages are waited out** for ``outage_tolerance`` seconds at every call, from the
  agent's first moment: a running job trains on, a joining agent keeps trying. Leases
  survive an etcd restart (etcd renews every lease when a leader takes over); a lost lease
  (etcd came back empty) is re-granted and the node re-joins. An etcd that stalls or restarts
  for longer than the TTL ends every lease, live nodes' too: they re-grant theirs, and their peers
  wait two TTLs for them before counting anyone gone (``_missing_members``).
- **Only success closes the round** (:meth:`EtcdRendezvousHandler.close_round`, called by
  the launcher after the job finished); a failed agent never strands its peers.

The agents' bootstrap store (rank assignment, the exit barrier) is :class:`EtcdStore`, under
the round's own prefix; the workers' store is the TCPStore that rank 0's worker hosts at the
address the round's state names (``use_agent_store`` is false).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import Any, Callable

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError, RendezvousConnectionError, RendezvousHandler, RendezvousInfo, RendezvousParameters,
    RendezvousStoreInfo, RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.registry import handler_registry

from training.launcher.etcd_v3 import (
    EtcdClient, EtcdRequestError, EtcdUnavailable, KeyValue, Read, none_created_after, op_delete, op_put, op_range,
    unchanged_since,
)
from training.contract import PROGRESS_FILE_ENV, STOP_BUDGET_ENV, RendezvousTuning
from training.launcher.topology import network_order, this_node_network

log = logging.getLogger(__name__)
BACKEND_NAME = "platform-etcd"
KEY_ROOT = "/platform/rendezvous"
# How often a waiting agent reads the state, and how often a running one checks for changes.
POLL_S = 0.1
CHECK_S = 0.2
# Up to this many nodes every agent keeps the rates above and the tuning's lease. A larger job spreads each
# agent's calls out in proportion to its size (up to MAX_STRETCH times), so that etcd serves about as many
# requests a second as for this many: with 256 agents at the small job's rates (14 calls a second each) a
# three-member etcd on 2 cores timed out and formed no round (benchmarks/rendezvous_scale.py). Stretched
# fully, a lost node is seen within a lease of STRETCHED_LEASE_S and a check, inside issue 52's 5 s.
STRETCH_ABOVE_NODES = 64
MAX_STRETCH = 4.0
STRETCHED_LEASE_S = 2.0


@dataclass(frozen=True)
class Rates:
    """How often one agent calls etcd, and its lease: the tuning's for a small job, stretched for a large one."""

    poll_s: float  # a waiting or joining agent's probe
    check_s: float  # a running agent's check (num_nodes_waiting)
    keep_alive_s: float
    lease_ttl_s: float

    @classmethod
    def for_job(cls, max_nodes: int, tuning: RendezvousTuning) -> "Rates":
        stretch = min(MAX_STRETCH, max(1.0, max_nodes / STRETCH_ABOVE_NODES))
        if stretch == 1.0:
            return cls(POLL_S, CHECK_S, tuning.keep_alive_interval, tuning.lease_ttl)
        lease = max(tuning.lease_ttl, STRETCHED_LEASE_S)
        # At least four renewals a lease, as the tuning has (0.25 s in 1 s): one late renewal does not lose the node.
        return cls(POLL_S * stretch, CHECK_S * stretch, min(tuning.keep_alive_interval * stretch, lease / 4), lease)

    @property
    def loss_noticed_within_s(self) -> float:
        """A dead node's key ends within a lease of its last renewal, and a check sees it then."""
        return self.lease_ttl_s + self.keep_alive_s + self.check_s
# A live member of the previous round that has not re-joined after its workers' stop budget and
# this margin (they are stuck stopping) no longer holds up the round; the last call decides.
REJOIN_MARGIN_S = 10.0
# Nodes' keys that went with their leases, while this node's own lease went too or etcd was just away,
# are given this many lease TTLs to come back before they count as gone (see _missing_members).
LEASE_DOUBT_TTLS = 2.0


class Outage:
    """When etcd stopped answering; a call fails for good only after ``tolerance_s`` of it."""

    def __init__(self, tolerance_s: float) -> None:
        self.tolerance_s = tolerance_s
        self.since: float | None = None
        self.ended_at = float("-inf")  # monotonic time etcd answered again after the last outage
        self._lock = threading.Lock()

    def failed(self, error: Exception) -> None:
        with self._lock:
            if self.since is None:
                self.since = time.monotonic()
                log.warning("etcd is unreachable (%s); waiting up to %.0f s for it, training goes on",
                            str(error).splitlines()[0][:200], self.tolerance_s)

    def answered(self) -> None:
        with self._lock:
            if self.since is not None:
                self.ended_at = time.monotonic()
                log.warning("etcd answers again after %.1f s", self.ended_at - self.since)
                self.since = None

    @property
    def exceeded(self) -> bool:
        return self.since is not None and time.monotonic() - self.since > self.tolerance_s


@dataclass
class RoundState:
    """The ``state`` key: the current round. ``members`` holds [node id, address, port] in rank order; a
    forming round's joiners are keys of their own (``join/<round id>/<node id>``)."""

    id: str
    status: str  # "forming" or "running"
    members: list[list[Any]] = field(default_factory=list)
    previous: list[str] = field(default_factory=list)  # member ids of the round before, for shrinks
    previous_id: str | None = None
    # Why it started: "first", "growth" (waiting nodes admitted), "lost" (a member is gone) or
    # "restart" (a member's workers failed). Only after "growth" can the old world checkpoint together.
    reason: str = "first"

    @property
    def member_ids(self) -> list[str]:
        return [m[0] for m in self.members]

    def encode(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def decode(cls, raw: bytes) -> "RoundState":
        known = {f.name for f in fields(cls)}  # a state an earlier launcher wrote has fields this one dropped
        return cls(**{key: value for key, value in json.loads(raw).items() if key in known})


@dataclass
class Snapshot:
    state: RoundState | None
    revision: int  # the state key's mod revision (0: absent)
    closed: bool
    live: dict[str, dict[str, Any]]  # node id -> its record, for every node whose lease is alive
    # What a probe compares (see _snapshot): the state's revision, the closed flag's and the live nodes'
    # counts, and the revision of the newest write to a node's key.
    signature: tuple[int, int, int, int] = (0, 0, 0, 0)


def tuning_from_params(params: RendezvousParameters) -> RendezvousTuning:
    """The ``--rdzv-conf`` keys of :class:`RendezvousTuning`, fractions of a second allowed."""
    defaults = RendezvousTuning()
    values = {}
    for item in fields(RendezvousTuning):
        raw = params.get(item.name)
        if raw is not None:
            values[item.name] = type(getattr(defaults, item.name))(float(raw))
    return replace(defaults, **values)


def free_port(host: str) -> int:
    """A port free on this node now, for rank 0's worker store (torch picks its own the same way)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, 0))
        except OSError:
            s.bind(("", 0))
        return s.getsockname()[1]


class EtcdRendezvousHandler(RendezvousHandler):
    """See the module docstring."""

    def __init__(self, run_id: str, min_nodes: int, max_nodes: int, client: EtcdClient, tuning: RendezvousTuning,
                 local_addr: str | None = None, warm_up: Callable[[], None] | None = None):
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"--nnodes: got {min_nodes}:{max_nodes}; allowed: 1 <= min <= max")
        self._run_id = run_id
        self._min, self._max = min_nodes, max_nodes
        self._client = client
        self._tuning = tuning
        self._rates = Rates.for_job(max_nodes, tuning)
        self._addr = local_addr or socket.getfqdn()
        self._node = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._prefix = f"{KEY_ROOT}/{run_id}/"
        self._outage = Outage(tuning.outage_tolerance)
        self._warm_up = warm_up
        # How long a survivor's workers may take to checkpoint and stop before it re-joins.
        self._rejoin_grace_s = float(os.environ.get(STOP_BUDGET_ENV, "30")) + REJOIN_MARGIN_S
        self._lease = 0
        self._lease_ttl_s = 1  # what etcd granted
        self._lease_lock = threading.Lock()
        self._stopping = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._round: RoundState | None = None  # the round this agent's workers run in
        self._round_started = 0.0  # wall clock, when next_rendezvous returned it
        self._training_since: float | None = None
        self._checked = 0.0
        self._waiting = 0
        self._last_snapshot: Snapshot | None = None  # answered again while a probe finds nothing changed
        self._lease_lost_at = float("-inf")  # monotonic time this node's own lease was found gone
        self._doubting = False  # members are missing and the verdict waits (logged once)
        # Whether the workers can still stop together with a checkpoint (see stop_gracefully).
        self._graceful = True
        self._network = this_node_network()  # in this node's record: the round's rank order follows it

    @classmethod
    def create(cls, params: RendezvousParameters, warm_up: Callable[[], None] | None = None
               ) -> "EtcdRendezvousHandler":
        """torch's handler registry calls this with the launcher's --rdzv-* flags. Talks to no etcd."""
        tuning = tuning_from_params(params)
        client = EtcdClient(params.endpoint, timeout_s=tuning.read_timeout)
        return cls(params.run_id, params.min_nodes, params.max_nodes, client, tuning, params.local_addr, warm_up)

    # --- the RendezvousHandler interface ------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def use_agent_store(self) -> bool:
        return False  # rank 0's worker hosts the workers' store; the agents' lives in etcd

    def is_closed(self) -> bool:
        return self._patiently(lambda: self._client.get(self._key("closed")) is not None)

    def set_closed(self) -> None:
        self._patiently(lambda: self._client.put(self._key("closed"), "1"))

    def close_round(self) -> None:
        """Close the rendezvous for good: the job finished. Later agents of this run id exit at once."""
        self.set_closed()

    def shutdown(self) -> bool:
        """Leave: stop heartbeating and revoke the lease, so peers see this node gone at once."""
        self._stopping.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=2 * self._rates.keep_alive_s + self._tuning.read_timeout)
        if self._lease:
            with contextlib.suppress(EtcdUnavailable, OSError):  # then the lease expires by itself
                self._client.lease_revoke(self._lease)
            self._lease = 0
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and wait until it completes; this node's rank, the world size, the stores."""
        started = time.monotonic()
        self._register()
        left = self._round
        self._round = None
        seen_joining: list[str] | None = None
        changed_at = time.monotonic()
        log.info("node %s joins the rendezvous of %s", self._node, self._run_id)
        while True:
            if time.monotonic() - started > self._tuning.join_timeout:
                raise RendezvousTimeoutError(
                    f"the rendezvous of {self._run_id} did not complete within {self._tuning.join_timeout} s "
                    f"(at least {self._min} node(s) needed)")
            snap = self._snapshot()
            if snap is None:
                time.sleep(self._rates.poll_s)
                continue
            if snap.closed:
                raise RendezvousClosedError(f"the rendezvous of {self._run_id} is closed: the job finished")
            state = snap.state
            if state is None or (state.status == "running" and left is not None and state.id == left.id):
                self._new_round(snap, previous=state)  # the first round, or this node leaves a running one
                continue
            if state.status == "running":
                if self._node in state.member_ids:
                    return self._joined(state)
                dead = [m for m in state.member_ids if m not in snap.live]
                if dead or not state.members:
                    self._new_round(snap, previous=state)  # the running round lost a member: start over
                    continue
                # The job runs without this node: it waits to be admitted (see num_nodes_waiting), as a
                # standby for as long as it takes; the join timeout is for a job that cannot start.
                started = time.monotonic()
                time.sleep(self._rates.poll_s)
                continue
            # A round is forming. Each node joins with a key of its own (join/<round>/<node>, on its lease: a
            # joiner that dies leaves with it), so joins do not contend for the state key; the oldest joiner
            # alive decides when the round starts, and the others watch a probe of a few bytes until it does.
            joiners = self._join_probe(state.id)
            if joiners is None:
                time.sleep(self._rates.poll_s)
                continue
            count, oldest, mine = joiners
            if not mine:
                if count < self._max:
                    self._join(snap, state)
                else:
                    time.sleep(self._rates.poll_s)  # full: it stays a standby of the round that forms
                continue
            if oldest != self._node:
                self._await_decision(snap, state, until=started + self._tuning.join_timeout)
                continue
            joiners = self._joiners(state.id)
            if joiners is None:
                time.sleep(self._rates.poll_s)
                continue
            joining, read_at = joiners
            joined_ids = [j[0] for j in joining]
            if self._node not in joined_ids:
                continue  # its own key went (a lost lease) since the probe: it joins again
            if joined_ids != seen_joining:
                seen_joining, changed_at = joined_ids, time.monotonic()
            if self._complete(state, snap, joining, changed_at):
                self._finish_round(snap, joining, read_at)
                continue
            time.sleep(self._rates.poll_s)

    def num_nodes_waiting(self) -> int:
        """Called by the agent between health checks: > 0 restarts this node's workers into a new round."""
        now = time.monotonic()
        if now - self._checked < self._rates.check_s:
            return self._waiting
        self._checked = now
        snap = self._snapshot(wait=False)
        if snap is None or snap.closed or self._round is None:
            self._waiting = 0
            return 0
        state = snap.state
        if state is None or state.id != self._round.id:
            log.warning("a new round of the rendezvous has started (%s); re-joining",
                        state.reason if state is not None else "etcd lost the state")
            self._waiting, self._graceful = 1, state is None or state.reason == "growth"
        elif gone := self._missing_members(state, snap, now):
            log.warning("%d node(s) of this round are gone (%s); re-forming the round without them", len(gone),
                        ", ".join(gone))
            self._waiting, self._graceful = 1, False
        else:
            waiting = [n for n, record in snap.live.items() if n not in state.member_ids and record.get("ready")]
            room = self._max - len(state.members)
            # Asked at every check, waiting nodes or not: the first check after the round's first report is
            # when it started training. Asked only once a node waited, it took the newest report for that
            # (the trainer rewrites the file at each), and a newcomer to a round that had trained for hours
            # waited scale_up_after_s after its arrival.
            due = self._admission_due()
            self._waiting = min(len(waiting), room) if waiting and room > 0 and due else 0
            self._graceful = True
            if self._waiting:
                log.info("admitting %d waiting node(s) after %.0f s of training in this round", self._waiting,
                         time.time() - (self._training_since or self._round_started))
        return self._waiting

    def _missing_members(self, state: RoundState, snap: Snapshot, now: float) -> list[str]:
        """The members of this round whose key is gone: their lease ended, they are dead.

        Unless etcd itself ended the leases: a member stalled or restarted longer than a lease's TTL
        (1 s) ends every lease at once, live nodes' too (a lease renewed after its expiry is not found:
        etcd 3.5 ``server/lease/lessor.go``, ``Renew``; a new leader extends every lease by one election
        timeout only, ``server/etcdserver/server.go``, ``applyEntryNormal``: ``Promote``). Reproduced
        with a real etcd stopped for 2 s (tests/drills/test_rendezvous_v3.py); a CI run of the etcd drill
        re-formed once, losing nothing, right after etcd came back. Each node saw its peers gone,
        and itself, and the job re-formed for nothing. So when this node's own key is missing (it is alive:
        etcd dropped its lease), its lease was found gone, or etcd was away, missing members get
        LEASE_DOUBT_TTLS lease TTLs to renew (each one re-grants its lease at its next keepalive,
        ``_keep_alive``) before they count as gone. A node that really died then is left behind
        that much later; a lost node without any etcd trouble is left behind as fast as before.
        """
        missing = [m for m in state.member_ids if m not in snap.live]
        if not missing:
            self._doubting = False
            return []
        if self._node in missing:
            self._lease_lost_at = max(self._lease_lost_at, now)
        grace = LEASE_DOUBT_TTLS * self._lease_ttl_s
        doubt_since = max(self._lease_lost_at, self._outage.ended_at)
        if now - doubt_since < grace:
            if not self._doubting:
                log.warning("%d node(s) of this round have no key in etcd right after etcd lost leases or was away "
                            "(%s); waiting up to %.1f s for them to renew before re-forming", len(missing),
                            ", ".join(missing), grace)
            self._doubting = True
            return []
        self._doubting = False
        return missing

    @property
    def loss_noticed_within_s(self) -> float:
        """How long after a node's death its peers' checks find it gone (the agent waits that for a lost peer)."""
        return self._rates.loss_noticed_within_s

    @property
    def stop_gracefully(self) -> bool:
        """Whether this node's workers should be given their stop budget to checkpoint before a restart.

        Only when every member of the round is alive and healthy (waiting nodes are admitted, or
        etcd lost the state): then they all stop at one step and checkpoint together. After a
        member died or its workers failed, a checkpoint needs that member's collectives and can
        never finish; the workers are stopped at once and the job resumes from the last one.
        """
        return self._graceful

    # --- rounds -----------------------------------------------------------------------------

    def _complete(self, state: RoundState, snap: Snapshot, joining: list[list[Any]], changed_at: float) -> bool:
        """Whether the forming round may start now (its oldest joiner decides it)."""
        joined = {j[0] for j in joining}
        if len(joined) < self._min:
            return False
        if len(joined) >= self._max:
            return True
        previous_alive = {n for n in state.previous if n in snap.live}
        waited = time.monotonic() - changed_at
        if not previous_alive <= joined and waited < self._rejoin_grace_s:
            return False  # a survivor of the last round is on its way: its workers are stopping
        if state.reason in ("lost", "restart") and joined <= set(state.previous):
            return True  # a shrink: nobody new to wait for, no last call
        if state.reason == "growth" and joined >= set(snap.live):
            return True  # an admission: every node alive has joined, nobody else is on the way
        return waited >= self._tuning.last_call_timeout  # growing: gather who arrives together

    def _new_round(self, snap: Snapshot, previous: RoundState | None) -> None:
        if previous is None:
            reason = "first"
        elif any(m not in snap.live for m in previous.member_ids):
            reason = "lost"
        else:
            reason = "growth" if self._waiting and self._graceful else "restart"
        state = RoundState(id=uuid.uuid4().hex[:12], status="forming", reason=reason,
                           previous=[m for m in (previous.member_ids if previous else []) if m in snap.live],
                           previous_id=previous.id if previous else None)
        if self._write(snap, state):
            log.info("node %s started round %s of the rendezvous (%s)", self._node, state.id, reason)

    def _join(self, snap: Snapshot, state: RoundState) -> None:
        """This node's join key for the forming round, on its lease, unless the state changed since ``snap``."""
        record = json.dumps([self._node, self._addr, free_port(self._addr)])
        try:
            self._client.txn([unchanged_since(self._key("state"), snap.revision)],
                             [op_put(self._key(f"join/{state.id}/{self._node}"), record, lease=self._lease)])
        except EtcdUnavailable as exc:
            self._outage.failed(exc)

    def _join_probe(self, round_id: str) -> tuple[int, str | None, bool] | None:
        """How many nodes have joined the forming round, the oldest of them, and whether this node is one."""
        read = self._read(self._join_ops(round_id))
        if read is None:
            return None
        oldest = read.ranges[0][0].key.rsplit("/", 1)[1] if read.ranges[0] else None
        return read.counts[0], oldest, read.counts[1] > 0

    def _join_ops(self, round_id: str) -> list[dict]:
        """A few bytes whatever the node count: the forming round's oldest joiner (and how many joined), and
        whether this node's join key is there."""
        return [op_range(self._key(f"join/{round_id}/"), prefix=True, keys_only=True, oldest_first=True, limit=1),
                op_range(self._key(f"join/{round_id}/{self._node}"), count_only=True)]

    def _joiners(self, round_id: str) -> tuple[list[list[Any]], int] | None:
        """Every node that joined the forming round, in the order they joined ([node id, address, port]), and
        the revision they were read at."""
        read = self._read([op_range(self._key(f"join/{round_id}/"), prefix=True, oldest_first=True)])
        return None if read is None else ([json.loads(kv.value) for kv in read.ranges[0]], read.revision)

    def _await_decision(self, snap: Snapshot, state: RoundState, until: float) -> None:
        """A joiner that does not decide: wait while the state is the one read in ``snap``, this node is still
        joined (its key goes with a lost lease) and another joiner is the oldest, until monotonic ``until``. A
        probe of a few bytes every poll, whatever the node count; everything is read again once one changes."""
        while time.monotonic() < until:
            time.sleep(self._rates.poll_s)
            read = self._read([op_range(self._key("state"), keys_only=True),
                               op_range(self._key("closed"), count_only=True), *self._join_ops(state.id)])
            if read is None:
                return
            current, _, oldest, _ = read.ranges
            if ((current[0].mod_revision if current else 0) != snap.revision or read.counts[1] or not read.counts[3]
                    or not oldest or oldest[0].key.rsplit("/", 1)[1] == self._node):
                return

    def _finish_round(self, snap: Snapshot, joining: list[list[Any]], read_at: int) -> None:
        state = snap.state
        # Survivors keep their order (rank 0 stays where the state is warm); newcomers follow. Then the
        # nodes whose network is known are put in network order, turned so that rank 0 stays (topology.py).
        order = {n: i for i, n in enumerate(state.previous)}
        members = sorted(joining, key=lambda j: (order.get(j[0], len(order)), joining.index(j)))
        members = members[:self._max]
        members = network_order(members, lambda j: tuple(snap.live.get(j[0], {}).get("network", ())),
                                first=members[0] if state.previous else None)
        done = replace(state, status="running", members=members)
        cleanup = [op_delete(self._key(f"join/{state.id}/"), prefix=True)]
        if state.previous_id:
            cleanup.append(op_delete(self._key(f"store/{state.previous_id}/"), prefix=True))
        # Unless a node joined after ``joining`` was read: then the round is decided again with it.
        if self._write(snap, done, cleanup, provided=[none_created_after(self._key(f"join/{state.id}/"), read_at)]):
            log.info("round %s of the rendezvous starts with %d node(s)", done.id, len(done.members))

    def _joined(self, state: RoundState) -> RendezvousInfo:
        self._round = state
        self._round_started = time.time()
        self._training_since = None
        self._waiting = 0
        rank = state.member_ids.index(self._node)
        _, master_addr, master_port = state.members[0]
        log.info("node %s is rank %d of %d in round %s", self._node, rank, len(state.members), state.id)
        store = EtcdStore(self._client, self._key(f"store/{state.id}/"), self._outage,
                          timeout=timedelta(seconds=self._tuning.join_timeout))
        return RendezvousInfo(store, rank, len(state.members), RendezvousStoreInfo(master_addr, int(master_port)))

    def _admission_due(self) -> bool:
        """Has this round trained ``scale_up_after_s`` since it started? A program that reports its
        progress (the packaged trainer, through the file the launcher names) has started training
        at its first report of this round, which the first check after it finds as the file's modification
        time; another at the round's start."""
        if self._training_since is None:
            path = os.environ.get(PROGRESS_FILE_ENV)
            if not path:
                self._training_since = self._round_started
            else:
                try:
                    reported = os.stat(path).st_mtime
                except OSError:
                    return False
                if reported < self._round_started:
                    return False
                self._training_since = reported
        return time.time() - self._training_since >= self._tuning.scale_up_after_s

    # --- etcd -------------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _snapshot(self, wait: bool = True) -> Snapshot | None:
        """The state, the closed flag and the live nodes, read together; None while etcd is away.

        Read whole only when something changed. Every agent checks five times a second (CHECK_S) and a
        standby polls ten times, so reading every node's key each time made etcd send N² bytes a second
        (benchmarks/rendezvous_scale.py: N^1.94 from 16 to 64 agents). A probe of a few bytes, whatever N is,
        reads this job's state key's revision, whether it is closed, how many of its nodes are live and the
        revision of the newest write to a node's key: a node's key that goes lowers the count, one that comes
        or comes back (a re-granted lease) raises the newest revision, and keepalives write nothing (0
        proposals a second while steady in that benchmark). When the probe matches the last snapshot's, that
        snapshot is still what etcd holds for this job and is answered again; other jobs' writes on a shared
        etcd do not count. The cache is dropped when etcd was away or this node's lease was replaced: an
        etcd back empty starts its revisions over.
        """
        last = self._last_snapshot
        if last is not None:
            probe = self._read([op_range(self._key("state"), keys_only=True),
                                op_range(self._key("closed"), count_only=True),
                                op_range(self._key("node/"), prefix=True, keys_only=True, newest_write_first=True,
                                         limit=1)], wait)
            if probe is None:
                return None
            state, _, newest = probe.ranges
            if (state[0].mod_revision if state else 0, *probe.counts[1:],
                    newest[0].mod_revision if newest else 0) == last.signature:
                return last
        read = self._read([op_range(self._key("state")), op_range(self._key("closed")),
                           op_range(self._key("node/"), prefix=True)], wait)
        if read is None:
            return None
        state, closed, nodes = read.ranges
        revision = state[0].mod_revision if state else 0
        self._last_snapshot = Snapshot(RoundState.decode(state[0].value) if state else None, revision, bool(closed),
                                       {kv.key.rsplit("/", 1)[1]: json.loads(kv.value) for kv in nodes},
                                       (revision, len(closed), len(nodes), max((kv.mod_revision for kv in nodes),
                                                                               default=0)))
        return self._last_snapshot

    def _read(self, ranges: list[dict], wait: bool = True) -> Read | None:
        """Range ops read together; None while etcd is away (after a pause, with ``wait``), up to the tolerance."""
        try:
            read = self._client.read(ranges)
        except EtcdUnavailable as exc:
            self._outage.failed(exc)
            self._last_snapshot = None  # etcd may come back empty, its revisions started over
            if self._outage.exceeded:
                raise RendezvousConnectionError(f"etcd has been unreachable for over "
                                                f"{self._outage.tolerance_s:.0f} s: {exc}") from exc
            if wait:
                time.sleep(min(1.0, 5 * self._rates.poll_s))
            return None
        self._outage.answered()
        return read

    def _write(self, snap: Snapshot, state: RoundState, also: list[dict] = (), provided: list[dict] = ()) -> bool:
        """Replace the state read in ``snap`` with ``state`` (and do ``also``) unless someone changed it meanwhile,
        provided every compare in ``provided`` holds too."""
        try:
            written, _ = self._client.txn([unchanged_since(self._key("state"), snap.revision), *provided],
                                          [op_put(self._key("state"), state.encode()), *also])
        except EtcdUnavailable as exc:
            self._outage.failed(exc)
            return False
        return written

    def _patiently(self, call: Callable[[], Any]) -> Any:
        """``call()``, retried while etcd is away, up to the outage tolerance."""
        delay = 0.1
        while True:
            try:
                result = call()
                self._outage.answered()
                return result
            except EtcdUnavailable as exc:
                self._outage.failed(exc)
                if self._outage.exceeded:
                    raise RendezvousConnectionError(f"etcd has been unreachable for over "
                                                    f"{self._outage.tolerance_s:.0f} s: {exc}") from exc
                time.sleep(delay)
                delay = min(2 * delay, 2.0)

    def _register(self) -> None:
        """Hold a lease and this node's key (once ready), and keep the lease alive from a thread."""
        if self._heartbeat is None:
            if self._warm_up is not None:
                # A node that comes after the job's end leaves before its warm-up (the trainer's import in
                # the worker server: 5 s or more), not after it.
                if (snap := self._snapshot()) is not None and snap.closed:
                    raise RendezvousClosedError(f"the rendezvous of {self._run_id} is closed: the job finished")
                self._warm_up()
            self._patiently(self._grant)
            self._heartbeat = threading.Thread(target=self._keep_alive, name="rendezvous-lease", daemon=True)
            self._heartbeat.start()

    def _grant(self) -> None:
        with self._lease_lock:
            lease, granted = self._client.lease_grant(max(1, round(self._rates.lease_ttl_s)))
            record = json.dumps({"addr": self._addr, "ready": True, "since": time.time(),
                                 **({"network": list(self._network)} if self._network else {})})
            # LeaseNotFound (an EtcdUnavailable) when etcd answered later than the TTL: the caller tries again.
            self._client.put(self._key(f"node/{self._node}"), record, lease=lease)
            if self._lease:  # a lease held before is gone
                self._lease_lost_at = time.monotonic()
                self._last_snapshot = None  # etcd may have come back empty: read everything again
                log.warning("this node's etcd lease was lost (etcd restarted without its data, stalled, or a "
                            "partition outlasted it); holding a new one")
            self._lease, self._lease_ttl_s = lease, granted
            if granted > self._rates.lease_ttl_s:
                log.info("etcd granted a %d s lease (its minimum) for the %g s asked", granted, self._rates.lease_ttl_s)

    def _keep_alive(self) -> None:
        while not self._stopping.wait(self._rates.keep_alive_s):
            try:
                if self._client.lease_keepalive(self._lease) == 0:
                    self._grant()  # the lease is gone, this node's key with it: peers see it back (_missing_members)
                self._outage.answered()
            except EtcdUnavailable as exc:
                self._outage.failed(exc)
            except EtcdRequestError as exc:  # the heartbeat must outlive any one refusal: peers count on it
                log.error("etcd refused this node's lease renewal: %s; trying again", exc)


class EtcdStore(Store):
    """torch's ``Store`` over etcd v3 keys under one prefix (the agents' store of one round).

    torch's agent uses it to assign worker ranks and for the exit barrier
    (agent/server/api.py ``_assign_worker_ranks``, ``_exit_barrier``); blocking reads poll.
    """

    def __init__(self, client: EtcdClient, prefix: str, outage: Outage, timeout: timedelta):
        super().__init__()  # the pybind trampoline needs it
        self._client = client
        self._prefix = prefix
        self._outage = outage
        self.set_timeout(timeout)

    def _retry(self, call: Callable[[], Any]) -> Any:
        while True:
            try:
                return call()
            except EtcdUnavailable as exc:
                self._outage.failed(exc)
                if self._outage.exceeded:
                    raise
                time.sleep(0.2)

    @staticmethod
    def _bytes(value: str | bytes) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value: str | bytes) -> None:
        self._retry(lambda: self._client.put(self._prefix + key, self._bytes(value)))

    def get(self, key: str) -> bytes:
        return self._wait_for([key])[key]

    def add(self, key: str, num: int) -> int:
        full = self._prefix + key
        while True:
            current: KeyValue | None = self._retry(lambda: self._client.get(full))
            value = (int(current.value) if current else 0) + num
            written, _ = self._retry(lambda current=current, value=value: self._client.txn(
                [unchanged_since(full, current.mod_revision if current else 0)], [op_put(full, str(value))]))
            if written:
                return value

    def check(self, keys: list[str]) -> bool:
        return all(self._retry(lambda k=k: self._client.get(self._prefix + k)) is not None for k in keys)

    def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:
        self._wait_for(keys, override_timeout)

    def _wait_for(self, keys: list[str], override_timeout: timedelta | None = None) -> dict[str, bytes]:
        deadline = time.monotonic() + (override_timeout or self.timeout).total_seconds()
        found: dict[str, bytes] = {}
        delay = 0.01
        while True:
            for key in keys:
                if key not in found:
                    kv = self._retry(lambda k=key: self._client.get(self._prefix + k))
                    if kv is not None:
                        found[key] = kv.value
            if len(found) == len(keys):
                return found
            if time.monotonic() > deadline:
                raise LookupError(f"timed out waiting for {sorted(set(keys) - set(found))} in the rendezvous store")
            time.sleep(delay)
            delay = min(2 * delay, POLL_S)


def register(warm_up: Callable[[], None] | None = None) -> None:
    """Make ``--rdzv-backend platform-etcd`` available to torch's agent in this process.

    ``warm_up`` runs once in the agent before its node registers (it then counts as ready to join).
    """
    handler_registry._registry.pop(BACKEND_NAME, None)  # a second call replaces the first
    handler_registry.register(BACKEND_NAME, lambda params: EtcdRendezvousHandler.create(params, warm_up))
