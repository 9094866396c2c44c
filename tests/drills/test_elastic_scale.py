"""Real agents (the pod's command, CPU, gloo) joining and leaving one job: the suite's small version
of benchmarks/elastic_scale.py. Behaviour only; the figures are the benchmark's (docs/elasticity-and-checkpoints.md).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace

import pytest

from tests.drill_harness import GLOBAL_BATCH, events, paced, sample_coverage, scale_drill, trainer_args
from training.contract import EXIT_STOPPED, NODE_LABELS_FILE_ENV, PLATFORM_TUNING, network_node_label
from trainctl.backends.local_cluster import Agent, LocalEtcd, wait_until

pytestmark = pytest.mark.timeout(600)

# Each job is held to 20 steps/s at its full size (data.synthetic_samples_per_s): these drills wait on
# arrivals, rounds and kills, not on steps (the most any waits for is 20), and an unpaced job trains
# as fast as the cores allow, which slows the very agent starts the drills wait for.
PACE_STEPS_PER_S = 20


def test_four_agents_arriving_at_once_reach_full_size_and_train_steadily(tmp_path):
    # 4 s steady: a heartbeat that wrote would show 16 writes an agent. No kill: test_lost_node.py kills one
    # of four agents and asserts more of the survivors than that they train again (8 s and a kill cost 7 s).
    result = scale_drill(tmp_path, 4, steady_s=4, kill=False, steps_per_s=PACE_STEPS_PER_S)
    assert result.full_world_s is not None, "\n".join(result.warnings)
    # Started together, they join one round; on a loaded machine one may come after the last call
    # and is then admitted once: never a restart per arrival.
    assert result.restarts <= 1, "\n".join(result.warnings)
    assert result.steady_rounds == 0, "\n".join(result.warnings)  # nothing re-rendezvoused while all four trained
    assert result.writes_per_s == 0  # heartbeats are lease renewals, not writes


def test_agents_arriving_one_by_one_are_admitted_in_batches(tmp_path):
    # Four arrivals 4 s apart with admission after 6 s of training: one restart per arrival would
    # be three; batching admits them in at most two.
    result = scale_drill(tmp_path, 4, spread_s=12, steady_s=1, kill=False,  # nothing asserted of the steady time
                         tuning=replace(PLATFORM_TUNING, scale_up_after_s=6), steps_per_s=PACE_STEPS_PER_S)
    assert result.full_world_s is not None, "\n".join(result.warnings)
    assert result.restarts <= 2, "\n".join(result.warnings)
    sizes = [e["world_size"] for e in events(tmp_path, "rendezvous")]
    assert sizes == sorted(sizes) and sizes[-1] == 4  # the world only grew


def test_an_agentstarted_while_etcd_is_down_waits_and_a_second_joins_it(tmp_path):
    etcd = LocalEtcd()
    args = [*trainer_args(tmp_path, 400_000), *paced(PACE_STEPS_PER_S, 2)]
    agents = [Agent("a", etcd.endpoint, "etcd-late", tmp_path, args, max_nodes=2)]
    try:
        # etcd is away until the agent has said it waits for it (training/launcher/rendezvous.py, Outage),
        # and 2 s more (5 s asserted nothing more): it waits, it does not exit.
        wait_until(lambda: re.search(r"etcd is unreachable \(.*\); waiting up to \d+ s for it", agents[0].output()),
                   "the agent waiting for etcd", 120, agents)
        time.sleep(2)
        assert agents[0].proc.poll() is None, agents[0].output()[-3000:]
        etcd.start()
        agents.append(Agent("b", etcd.endpoint, "etcd-late", tmp_path, args, max_nodes=2))
        wait_until(lambda: [e for e in events(tmp_path, "step") if e["world_size"] == 2], "both training",
                   240, agents)
    finally:
        for agent in agents:
            agent.stop()
        etcd.__exit__()


def _node_ranks(agent: Agent) -> list[dict]:
    return [json.loads(line) for line in agent.output().splitlines() if line.startswith('{"event": "node_ranks"')]


def test_a_scale_up_keeps_the_survivors_workers_puts_the_newcomer_in_network_order_and_loses_no_step(
        tmp_path, etcd_module):
    """Beyond torchrun: the running members' workers stay up through an admission. They stop at
    one step, leave their process group, and join the bigger round in place; only the newcomer
    starts a worker, and it receives the state from a survivor: nobody reads a checkpoint.

    On EKS each node's agent reads its network labels (training/node_labels.py, then
    training/launcher/topology.py). Here c hangs from a's layer-3 network node and b from another, so
    c's admission puts it at rank 1, between the survivors, and b moves to rank 2: a survivor's rank
    changes in place. At the end no sample has been trained twice, through two admissions and a crash.
    (One job for both: each agent's start costs about 6.5 core-seconds, and both drills need the same
    two-node job scaled up.)"""
    networks = {"a": ("nn-1", "nn-1a", "nn-1a1"), "b": ("nn-2", "nn-2a", "nn-2a1"),
                "c": ("nn-1", "nn-1a", "nn-1a1"), "d": ("nn-2", "nn-2a", "nn-2a1")}
    args = [*trainer_args(tmp_path, 400_000), *paced(PACE_STEPS_PER_S, 4)]

    def start(name: str) -> Agent:
        labels = tmp_path / f"{name}-labels.json"
        labels.write_text(json.dumps({network_node_label(layer + 1): node for layer, node in enumerate(networks[name])}))
        # min_nodes 2: a and b make the first round together, in network order, whichever starts faster.
        return Agent(name, etcd_module, "in-place", tmp_path, args, min_nodes=2, max_nodes=4,
                     env={NODE_LABELS_FILE_ENV: str(labels)})

    agents = [start(name) for name in "ab"]
    try:
        # Past step 25 (8 reports of 5 steps): a checkpoint exists, and is hidden below.
        wait_until(lambda: len([e for e in events(tmp_path, "step") if e["world_size"] == 2]) >= 8,
                   "two nodes training", 120, agents)
        before = {a.name: _node_ranks(a)[-1]["group_rank"] for a in agents}
        workers = {agent.name: agent.worker_pids() for agent in agents}
        # Every checkpoint moved away: a member that read one would find none and start at step 0.
        checkpoints = tmp_path / "checkpoints"
        hidden = tmp_path / "hidden-checkpoints"
        hidden.mkdir()
        for path in checkpoints.glob("step-*.pt"):
            path.rename(hidden / path.name)
        joined_at = time.time()
        agents.append(start("c"))
        # Three reports at size 3: the round's ranks are out (node_ranks comes before the first step).
        wait_until(lambda: len([e for e in events(tmp_path, "step") if e["world_size"] == 3]) >= 3,
                   "three nodes training", 120, agents)
        after = {a.name: _node_ranks(a)[-1]["group_rank"] for a in agents}
        assert before == {"a": 0, "b": 1} and after == {"a": 0, "c": 1, "b": 2}
        assert {agent.name: agent.worker_pids() for agent in agents[:2]} == workers  # the same processes
        for agent in agents[:2]:
            assert "joined round 1 in place" in agent.output()
        last_of_two = max(e["step"] for e in events(tmp_path, "step") if e["world_size"] == 2)
        resume = [e for e in events(tmp_path, "resume") if e["time"] > joined_at]
        assert resume and resume[0]["step"] >= last_of_two  # nothing trained is lost
        assert resume[0]["checkpoint"] is None and resume[0]["bytes_read"] == 0 and resume[0]["bytes_from_peer"] > 0
        assert "regroup_s" in resume[0]
        paused = [e for e in events(tmp_path, "stop") if e["time"] > joined_at]
        assert paused and all(e["regroup"] and e["signal"] is None for e in paused), paused  # said as no stop
        assert not [e for e in events(tmp_path, "checkpoint_started") if e["time"] > joined_at
                    and e["step"] == resume[0]["step"]]  # no checkpoint written for the regroup

        # A crash restarts every worker; the next admission is in place again. (An agent that kept
        # counting its in-place rounds across that restart waited its whole stop budget for a pause
        # its new workers never wrote, then restarted them: seen as a flake of the batching test.)
        crashed_at = agents[2].kill_workers()
        wait_until(lambda: [e for e in events(tmp_path, "step") if e["time"] > crashed_at + 1 and e["world_size"] == 3],
                   "three nodes training again after the crash", 120, agents)
        workers = {agent.name: agent.worker_pids() for agent in agents}
        agents.append(start("d"))
        wait_until(lambda: [e for e in events(tmp_path, "step") if e["world_size"] == 4], "four nodes training",
                   120, agents)
        assert {agent.name: agent.worker_pids() for agent in agents[:3]} == workers
        for agent in agents:
            assert "did not pause" not in agent.output(), agent.output()[-3000:]
        for agent in agents:
            agent.terminate()
        assert [a.wait(timeout=120) for a in agents] == [EXIT_STOPPED] * 4, [a.output()[-2000:] for a in agents]
    finally:
        for agent in agents:
            agent.stop()
    steps, seen = sample_coverage(tmp_path, 400_000, 1)
    counts = seen[0]
    assert set(counts.values()) == {1} and len(counts) == steps * GLOBAL_BATCH  # each counted step's samples, once
