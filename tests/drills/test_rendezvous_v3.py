"""The platform's rendezvous on etcd's v3 API, handler by handler, against a real etcd 3.5 on loopback.

No trainer here: handlers run in threads of this process, as torch's agent would drive them
(``next_rendezvous``, then ``num_nodes_waiting`` between health checks). The agents' own
behaviour with real processes is in test_elastic_scale.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import replace

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.elastic.utils.store import barrier

from tests.drill_harness import etcd_metrics
from training.launcher.etcd_v3 import EtcdClient, EtcdUnavailable, LeaseNotFound, op_put, unchanged_since
from training.contract import PLATFORM_TUNING, PROGRESS_FILE_ENV
from trainctl.backends.local_cluster import LocalEtcd, free_port
from training.launcher.rendezvous import (
    LEASE_DOUBT_TTLS, EtcdRendezvousHandler, EtcdStore, Outage, Rates, RoundState,
)

# Light: its deadlines are etcd's leases, and its handlers run in threads of this process, which waits on them
# (23 tests: 44 s wall, 3.5 core-seconds alone on 2 cores). make test runs it beside the timed drills at full
# priority, where it takes none of their time (Makefile, LIGHT_TIMED_TESTS).
pytestmark = [pytest.mark.light, pytest.mark.timeout(120)]


def handler(endpoint: str, run_id: str, min_nodes: int = 1, max_nodes: int = 4, **tuning) -> EtcdRendezvousHandler:
    return EtcdRendezvousHandler(run_id, min_nodes, max_nodes, EtcdClient(endpoint, timeout_s=2),
                                 replace(PLATFORM_TUNING, **tuning), local_addr="127.0.0.1")


def join_all(handlers: list[EtcdRendezvousHandler]) -> list:
    """next_rendezvous on each, concurrently; their RendezvousInfos in order."""
    results: list = [None] * len(handlers)

    def join(i: int) -> None:
        results[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(results), "a node never completed its rendezvous"
    return results


def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# --- the client ------------------------------------------------------------------------------


def test_the_client_reads_writes_and_compares_through_the_v3_gateway(etcd_module):
    client = EtcdClient(etcd_module)
    client.put("/t/a", b"1")
    kv = client.get("/t/a")
    assert kv.value == b"1"
    # A transaction whose compare is stale does nothing; a fresh one writes.
    assert client.txn([unchanged_since("/t/a", kv.mod_revision + 100)], [op_put("/t/a", "2")])[0] is False
    assert client.txn([unchanged_since("/t/a", kv.mod_revision)], [op_put("/t/a", "2")])[0] is True
    assert client.txn([unchanged_since("/t/new", 0)], [op_put("/t/new", "x")])[0] is True  # create-if-absent
    assert client.txn([unchanged_since("/t/new", 0)], [op_put("/t/new", "y")])[0] is False
    assert sorted(kv.key for kv in client.get_prefix("/t/")) == ["/t/a", "/t/new"]
    assert client.delete("/t/", prefix=True) == 2


def test_a_key_on_a_lease_lives_while_it_is_renewed_and_goes_when_it_is_not(etcd_module):
    client = EtcdClient(etcd_module)
    lease, granted = client.lease_grant(1)
    assert granted == 1  # the platform's etcd flags allow 1 s leases (etcd's default minimum is 2 s)
    client.put("/t/node", "alive", lease=lease)
    for _ in range(8):  # 2 s of renewals at the shipped interval
        assert client.lease_keepalive(lease) > 0
        time.sleep(PLATFORM_TUNING.keep_alive_interval)
    assert client.get("/t/node") is not None
    stopped = time.monotonic()
    until(lambda: client.get("/t/node") is None, 5, "the key of an unrenewed lease to go")
    assert client.lease_keepalive(lease) == 0  # gone: the holder learns it must grant a new one
    assert time.monotonic() - stopped < 3


def test_a_lease_that_ended_before_its_key_was_written_is_replaced_and_the_heartbeat_goes_on(etcd_module):
    """With 64 simulated agents on a loaded machine, etcd answered a node's put later than its new lease's
    1 s TTL: the put was refused as NotFound, the client failed on the reply and the heartbeat thread died,
    leaving a live agent without a key. Now the write names the ended lease and a new one is granted."""
    client = EtcdClient(etcd_module)
    lease, _ = client.lease_grant(1)
    client.lease_revoke(lease)
    with pytest.raises(LeaseNotFound, match=f"lease {lease}"):
        client.put("/t/late", "x", lease=lease)
    node = handler(etcd_module, "late-lease")
    grant = node._client.lease_grant
    ended: list[int] = []

    def slow_grant(ttl):  # the first lease ends before the put, as under that load
        lease, granted = grant(ttl)
        if not ended:
            ended.append(lease)
            node._client.lease_revoke(lease)
        return lease, granted

    node._client.lease_grant = slow_grant
    try:
        node._register()
        assert node._lease and node._lease != ended[0]
        assert node._node in node._snapshot().live
        node._client.lease_revoke(node._lease)  # and once running: the heartbeat re-grants, it does not die
        until(lambda: node._heartbeat.is_alive() and node._node in (node._snapshot() or node._last_snapshot).live,
              5, "the node's key back on a new lease")
    finally:
        node.shutdown()


def test_an_unreachable_etcd_is_one_kind_of_error_and_fast():
    client = EtcdClient(f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}", timeout_s=1)
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable):
        client.get("/anything")
    assert time.monotonic() - started < 2


def test_a_malformed_endpoint_is_named():
    with pytest.raises(ValueError, match="rdzv endpoint: got 'etcd'"):
        EtcdClient("etcd")


# --- the agents' store -------------------------------------------------------------------------


def test_the_store_serves_torchs_barrier_and_counters(etcd_module):
    from datetime import timedelta

    prefix = f"/t/store-{time.time_ns()}/"
    stores = [EtcdStore(EtcdClient(etcd_module), prefix, Outage(10), timedelta(seconds=20)) for _ in range(3)]
    stores[0].set("k", "v")
    assert stores[1].get("k") == b"v" and stores[2].check(["k"]) and not stores[2].check(["nope"])
    assert sorted(stores[i].add("n", 1) for i in range(3)) == [1, 2, 3]
    done = []
    threads = [threading.Thread(target=lambda s=s: (barrier(s, 3, "b/", 20), done.append(1))) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(done) == 3
    with pytest.raises(LookupError):
        stores[0].wait(["never"], timedelta(seconds=0.3))


# --- rounds ------------------------------------------------------------------------------------


def test_nodes_that_arrive_together_form_one_round_and_heartbeats_write_nothing(etcd_module):
    nodes = [handler(etcd_module, "together", max_nodes=3) for _ in range(3)]
    try:
        infos = join_all(nodes)
        assert sorted(info.rank for info in infos) == [0, 1, 2] and {info.world_size for info in infos} == {3}
        # Every node learns rank 0's address for the workers' store.
        assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}) == 1
        before = etcd_metrics(etcd_module)["etcd_server_proposals_committed_total"]
        quiet_until = time.monotonic() + 3
        while time.monotonic() < quiet_until:  # the agents' health-check loop
            assert [n.num_nodes_waiting() for n in nodes] == [0, 0, 0]
            time.sleep(0.1)
        # 3 s of heartbeats (12 lease renewals per node) and checks: no write reached Raft.
        assert etcd_metrics(etcd_module)["etcd_server_proposals_committed_total"] == before
    finally:
        for node in nodes:
            node.shutdown()


def replies(node: EtcdRendezvousHandler) -> list[int]:
    """From now on, the size in bytes of every reply etcd sends ``node`` (as JSON, as the gateway sends it)."""
    sizes: list[int] = []
    call = node._client.call

    def counted(path, body):
        reply = call(path, body)
        sizes.append(len(json.dumps(reply)))
        return reply

    node._client.call = counted
    return sizes


@pytest.mark.parametrize("standbys", [1, 200])
def test_a_steady_check_reads_the_same_few_bytes_however_many_nodes_are_live(etcd_module, standbys):
    """Issue 52: every agent checks five times a second, and each check read every node's key (etcd sent N² bytes
    a second). Now a check reads a probe whose size does not depend on the node count while nothing changes,
    heartbeats included, and reads everything again once something does."""
    run = f"steady-{standbys}"
    nodes = [handler(etcd_module, run, max_nodes=2) for _ in range(2)]
    client = EtcdClient(etcd_module)
    lease, _ = client.lease_grant(30)
    try:
        join_all(nodes)
        for index in range(standbys):  # waiting nodes' keys, not admitted: the round is full
            client.put(f"/platform/rendezvous/{run}/node/standby-{index}", json.dumps({"ready": True}), lease=lease)
        checker = nodes[0]
        checker._checked = 0.0
        assert checker.num_nodes_waiting() == 0  # a full read: the standbys are new
        whole = checker._last_snapshot
        assert len(whole.live) == standbys + 2
        sizes = replies(checker)
        quiet_until = time.monotonic() + 1.5  # six keepalives of each node meanwhile
        while time.monotonic() < quiet_until:
            checker._checked = 0.0
            assert checker.num_nodes_waiting() == 0
            time.sleep(0.05)
        assert len(sizes) > 10 and max(sizes) < 1000, sizes  # a probe: about the same bytes for 1 standby or 200
        assert checker._last_snapshot is whole  # answered from the last whole read
        # A change is read whole: a node leaves, the next check sees it and reads every node's key again.
        client.delete(f"/platform/rendezvous/{run}/node/standby-0")
        checker._checked = 0.0
        checker.num_nodes_waiting()
        assert checker._last_snapshot is not whole and len(checker._last_snapshot.live) == standbys + 1
        assert sizes[-1] > 100 * standbys  # the whole read, as large as the node count makes it
    finally:
        client.lease_revoke(lease)
        for node in nodes:
            node.shutdown()


def test_a_large_job_calls_etcd_less_often_and_still_notices_a_loss_within_its_budget(etcd_module):
    """Up to 64 nodes the shipped rates hold (the 16-agent drills are unchanged); a job of 256 or 1,024 spreads
    each agent's calls four times out (a 2 s lease renewed every 0.5 s, a check every 0.8 s): etcd serves about
    what it serves for 64. A dead node is still noticed within a lease and a check, inside issue 52's 5 s."""
    assert Rates.for_job(16, PLATFORM_TUNING) == Rates(0.1, 0.2, PLATFORM_TUNING.keep_alive_interval,
                                                       PLATFORM_TUNING.lease_ttl)
    assert Rates.for_job(64, PLATFORM_TUNING) == Rates.for_job(16, PLATFORM_TUNING)
    large = Rates.for_job(1024, PLATFORM_TUNING)
    assert large == Rates.for_job(256, PLATFORM_TUNING) == Rates(0.4, 0.8, 0.5, 2.0)
    nodes = [handler(etcd_module, "large", min_nodes=1, max_nodes=1024, last_call_timeout=1) for _ in range(2)]
    try:
        join_all(nodes)
        assert nodes[0]._lease_ttl_s == 2
        survivor, victim = nodes
        victim._stopping.set()  # its pod is gone: no more renewals, no revoke
        died = time.monotonic()
        until(lambda: survivor.num_nodes_waiting(), 10, "the survivor to notice")
        assert time.monotonic() - died < large.lease_ttl_s + large.check_s + 1.0
    finally:
        for node in nodes:
            node.shutdown()


def test_a_node_that_joins_while_the_oldest_decides_is_not_left_out(etcd_module):
    """Joins are keys of their own, so the state key's revision does not see them: the round is written only
    if no join key was created after the oldest joiner read them; else it decides again with the newcomer."""
    a, b, c = (handler(etcd_module, "late-join", min_nodes=1, max_nodes=3) for _ in range(3))
    try:
        for node in (a, b, c):
            node._register()
        a._new_round(a._snapshot(), previous=None)
        for node in (a, b):
            snap = node._snapshot()
            node._join(snap, snap.state)
        joining, read_at = a._joiners(a._snapshot().state.id)
        assert [j[0] for j in joining] == [a._node, b._node]
        snap = c._snapshot()
        c._join(snap, snap.state)  # lands between the oldest's read and its decision
        a._finish_round(a._snapshot(), joining, read_at)
        assert a._snapshot().state.status == "forming"  # not decided without c
        joining, read_at = a._joiners(a._snapshot().state.id)
        a._finish_round(a._snapshot(), joining, read_at)
        assert a._snapshot().state.member_ids == [a._node, b._node, c._node]
    finally:
        for node in (a, b, c):
            node.shutdown()


def test_another_jobs_writes_do_not_make_a_check_read_everything(etcd_module):
    """The probe is of this job's keys: on the platform's shared etcd, other jobs' rounds and leases change the
    store's revision all the time, and must not cost every agent a whole read."""
    nodes = [handler(etcd_module, "mine", max_nodes=2) for _ in range(2)]
    other = EtcdClient(etcd_module)
    try:
        join_all(nodes)
        checker = nodes[0]
        checker._checked = 0.0
        checker.num_nodes_waiting()
        whole = checker._last_snapshot
        for index in range(5):
            other.put(f"/platform/rendezvous/theirs/node/n{index}", "{}")
            checker._checked = 0.0
            assert checker.num_nodes_waiting() == 0
        assert checker._last_snapshot is whole
    finally:
        for node in nodes:
            node.shutdown()


def test_a_state_an_earlier_launcher_wrote_is_read():
    """The previous form of the state held its joiners in it; a leftover one must not fail the agent."""
    state = RoundState.decode(b'{"id": "r1", "status": "forming", "joining": [["n", "a", 1]], "members": [], '
                              b'"previous": [], "previous_id": null, "reason": "first"}')
    assert (state.id, state.status, state.members) == ("r1", "forming", [])


def test_a_dead_node_is_left_behind_when_its_lease_ends_with_no_last_call(etcd_module):
    # A last call this long would show: the shrink must not wait for it.
    nodes = [handler(etcd_module, "shrink", max_nodes=3, last_call_timeout=30) for _ in range(3)]
    survivors, victim = nodes[:2], nodes[2]
    try:
        join_all(nodes)
        victim._stopping.set()  # its pod is gone: no more renewals, and no goodbye
        died = time.monotonic()
        until(lambda: all(n.num_nodes_waiting() for n in survivors), 5, "the survivors to notice")
        assert time.monotonic() - died < PLATFORM_TUNING.lease_ttl + 2.5
        assert not any(n.stop_gracefully for n in survivors)  # no checkpoint can finish without the dead node
        infos = join_all(survivors)
        assert {info.world_size for info in infos} == {2}
        assert time.monotonic() - died < 10  # far inside the last call
    finally:
        for node in nodes:
            node.shutdown()


def test_leases_that_etcd_itself_ends_do_not_break_up_a_running_round(tmp_path):
    # etcd ends every lease at once when it stalls or restarts for longer than their TTL (1 s): live
    # nodes' keys go too, and each node re-grants its lease at its next keepalive. Before, each node
    # took its peers (and itself) for dead and the job re-formed (a CI run of the etcd drill, once).
    etcd = LocalEtcd()
    nodes = [handler(etcd.start(), "doubt", max_nodes=2) for _ in range(2)]
    try:
        join_all(nodes)
        # What etcd does after a stall, done at once to both leases (deterministic): the keys go.
        for node in nodes:
            node._client.lease_revoke(node._lease)
        nodes[0]._checked = 0.0
        assert nodes[0].num_nodes_waiting() == 0  # its own key is gone too: etcd's doing, not a death
        # And the real thing: etcd stopped for 2 s, as a stalled disk or a paused VM does.
        os.kill(etcd.proc.pid, signal.SIGSTOP)
        time.sleep(2.0)
        os.kill(etcd.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            assert not any(node.num_nodes_waiting() for node in nodes), "a live node was taken for dead"
            time.sleep(0.05)
        live = nodes[0]._snapshot().live
        assert {node._node for node in nodes} <= set(live)  # both renewed: new leases, same keys
    finally:
        for node in nodes:
            node.shutdown()
        etcd.__exit__()


def test_a_node_that_dies_while_etcd_stalls_is_still_left_behind(tmp_path):
    etcd = LocalEtcd()
    nodes = [handler(etcd.start(), "doubt-dead", max_nodes=3) for _ in range(3)]
    survivors, victim = nodes[:2], nodes[2]
    try:
        join_all(nodes)
        os.kill(etcd.proc.pid, signal.SIGSTOP)
        victim._stopping.set()  # its pod is gone meanwhile: it will not renew
        time.sleep(2.0)
        os.kill(etcd.proc.pid, signal.SIGCONT)
        back = time.monotonic()
        until(lambda: all(n.num_nodes_waiting() for n in survivors), 10, "the survivors to notice")
        # The doubt lasts LEASE_DOUBT_TTLS leases from the moment a survivor's own lease was found gone.
        assert time.monotonic() - back < LEASE_DOUBT_TTLS * PLATFORM_TUNING.lease_ttl + 2.5
        assert victim._node not in survivors[0]._snapshot().live
    finally:
        for node in nodes:
            node.shutdown()
        etcd.__exit__()


def test_a_clean_exit_is_seen_at_once(etcd_module):
    nodes = [handler(etcd_module, "leave", max_nodes=2, lease_ttl=10) for _ in range(2)]
    try:
        join_all(nodes)
        nodes[1].shutdown()  # revokes its lease: no TTL to wait out
        left = time.monotonic()
        until(lambda: nodes[0].num_nodes_waiting(), 3, "the peer's departure")
        assert time.monotonic() - left < 1.0
    finally:
        nodes[0].shutdown()


def test_arrivals_during_a_running_round_wait_and_then_join_together(etcd_module):
    first = handler(etcd_module, "growth", max_nodes=3, scale_up_after_s=3, last_call_timeout=1)
    late = [handler(etcd_module, "growth", max_nodes=3, scale_up_after_s=3, last_call_timeout=1) for _ in range(2)]
    try:
        (info,) = join_all([first])
        assert info.world_size == 1
        started = time.monotonic()
        joined: list = []
        threads = [threading.Thread(target=lambda n=n: joined.append(n.next_rendezvous())) for n in late]
        for thread in threads:
            thread.start()
            time.sleep(1)  # they arrive one after the other
        while time.monotonic() - started < 2.5:
            assert first.num_nodes_waiting() == 0, "admitted before the round trained scale_up_after_s"
            time.sleep(0.1)
        waiting = until(first.num_nodes_waiting, 5, "the admission")
        assert waiting == 2 and first.stop_gracefully  # everyone alive: the old world checkpoints first
        (again,) = join_all([first])
        for thread in threads:
            thread.join(timeout=30)
        assert again.world_size == 3 and again.rank == 0  # the survivor keeps rank 0
        assert sorted(i.rank for i in joined) == [1, 2]
    finally:
        for node in [first, *late]:
            node.shutdown()


def test_a_node_arriving_after_the_round_trained_long_enough_is_admitted_at_the_first_check(
        etcd_module, tmp_path, monkeypatch):
    """The round's time is counted from its first progress report, not from the newest one: the trainer
    rewrites the file at every report, and a handler that looked at it only once a node waited made every
    newcomer wait ``scale_up_after_s`` after its arrival, however long the round had trained."""
    progress = tmp_path / "progress"
    monkeypatch.setenv(PROGRESS_FILE_ENV, str(progress))
    first = handler(etcd_module, "trained", max_nodes=2, scale_up_after_s=2, last_call_timeout=0.5)
    late = handler(etcd_module, "trained", max_nodes=2, scale_up_after_s=2, last_call_timeout=0.5)
    try:
        join_all([first])
        reported = time.monotonic()
        while time.monotonic() - reported < 2.5:  # reports, and the agent's checks between them, as it trains
            progress.write_text("1")
            assert first.num_nodes_waiting() == 0
            time.sleep(0.1)
        joining = threading.Thread(target=late.next_rendezvous, daemon=True)
        joining.start()
        until(lambda: late._node in first._snapshot().live and first._snapshot().live[late._node].get("ready"), 10,
              "the newcomer waiting")
        progress.write_text("1")  # a report just before the check, as one is every few steps
        first._checked = float("-inf")  # the check is due: the agent's next health check
        assert first.num_nodes_waiting() == 1, "the newcomer waits although the round trained scale_up_after_s"
        (again,) = join_all([first])  # and they form the next round together
        joining.join(timeout=30)
        assert again.world_size == 2
    finally:
        for node in (first, late):
            node.shutdown()


def test_below_min_nodes_nobody_waits_for_an_admission(etcd_module):
    nodes = [handler(etcd_module, "minimum", min_nodes=2, max_nodes=2, scale_up_after_s=600) for _ in range(2)]
    try:
        thread = threading.Thread(target=lambda: nodes[0].next_rendezvous())
        thread.start()
        time.sleep(1)
        assert thread.is_alive()  # one node is below the minimum: it waits for the round to fill
        info = nodes[1].next_rendezvous()
        thread.join(timeout=10)
        assert info.world_size == 2
    finally:
        for node in nodes:
            node.shutdown()


def test_a_closed_rendezvous_turns_late_nodes_away(etcd_module):
    done = handler(etcd_module, "closed")
    try:
        join_all([done])
        done.close_round()
        late = handler(etcd_module, "closed")
        with pytest.raises(RendezvousClosedError):
            late.next_rendezvous()
        late.shutdown()
    finally:
        done.shutdown()


def test_a_node_created_while_etcd_is_down_waits_for_it(tmp_path):
    etcd = LocalEtcd()
    try:
        node = handler(etcd.endpoint, "patient")  # torch's registry builds it: no etcd call yet
        result: list = []
        thread = threading.Thread(target=lambda: result.append(node.next_rendezvous()))
        thread.start()
        time.sleep(3)
        assert thread.is_alive() and not result  # waiting, not failed
        etcd.start()
        thread.join(timeout=30)
        assert result and result[0].world_size == 1
        node.shutdown()
    finally:
        etcd.__exit__()


def test_ranks_follow_the_nodes_network_and_a_newcomer_takes_its_place_in_it(etcd_module, tmp_path, monkeypatch):
    """Nodes whose pods read their node's EKS labels get ranks in network order (training/launcher/
    topology.py): the first round sorts them; an admission puts the newcomer next to its network
    neighbours and turns the ring so that rank 0 keeps its node."""
    import json

    from tests.unit.test_network_order import DATA, NETWORK
    from training.contract import NODE_LABELS_FILE_ENV
    from training.launcher.topology import network_order

    def labelled(i: int) -> EtcdRendezvousHandler:
        path = tmp_path / f"labels-{i}.json"
        path.write_text(json.dumps(DATA["nodes"][i]["labels"]))
        monkeypatch.setenv(NODE_LABELS_FILE_ENV, str(path))
        return handler(etcd_module, "network", min_nodes=4, max_nodes=5, scale_up_after_s=0, last_call_timeout=1)

    names = [node["name"] for node in DATA["nodes"]]
    # The newcomer's layer-3 network node is one of the first four's, and not the first in order.
    first_four = names[:4]
    newcomer = next(i for i, name in enumerate(names[4:], 4)
                    if network_order([*first_four, name], NETWORK.get).index(name) in (1, 2, 3))
    nodes = [labelled(i) for i in range(4)]
    late = labelled(newcomer)
    try:
        infos = join_all(nodes)
        ranked = [names[i] for i in sorted(range(4), key=lambda i: infos[i].rank)]
        # Nodes under one network node keep the order they joined in, which the threads' race decides.
        assert [NETWORK[n] for n in ranked] == sorted(NETWORK[n] for n in first_four) != [NETWORK[n] for n in first_four]
        joined: list = []
        thread = threading.Thread(target=lambda: joined.append(late.next_rendezvous()))
        thread.start()
        until(lambda: all([node.num_nodes_waiting() for node in nodes]), 10, "the admission")  # each agent's check
        again = join_all(nodes)
        thread.join(timeout=30)
        ranks = {names[i]: info.rank for i, info in enumerate(again)} | {names[newcomer]: joined[0].rank}
        order = sorted(ranks, key=ranks.get)
        assert order == network_order([*ranked, names[newcomer]], NETWORK.get, first=ranked[0])
        assert order[0] == ranked[0] and order.index(names[newcomer]) not in (0, 4)
    finally:
        for node in [*nodes, late]:
            node.shutdown()
