"""Real agents (the pod's command, CPU, gloo) joining and leaving one job: the suite's small version
of benchmarks/elastic_scale.py. Behaviour only; the figures are the benchmark's (docs/elasticity-and-checkpoints.md).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from tests.drill_harness import events, scale_drill, trainer_args
from training.contract import PLATFORM_TUNING
from trainctl.backends.local_cluster import Agent, LocalEtcd, wait_until

pytestmark = pytest.mark.timeout(600)


def test_four_agents_arriving_at_once_reach_full_size_train_steadily_and_survive_a_kill(tmp_path):
    result = scale_drill(tmp_path, 4, steady_s=15)
    assert result.full_world_s is not None, "\n".join(result.warnings)
    # Started together, they join one round; on a loaded machine one may come after the last call
    # and is then admitted once: never a restart per arrival.
    assert result.restarts <= 1, "\n".join(result.warnings)
    assert result.steady_rounds == 0, "\n".join(result.warnings)  # nothing re-rendezvoused while all four trained
    assert result.writes_per_s == 0  # heartbeats are lease renewals, not writes
    assert result.kill_to_step_s is not None  # the three survivors trained again


def test_agents_arriving_one_by_one_are_admitted_in_batches(tmp_path):
    # Four arrivals 4 s apart with admission after 6 s of training: one restart per arrival would
    # be three; batching admits them in at most two.
    result = scale_drill(tmp_path, 4, spread_s=12, steady_s=5, kill=False,
                         tuning=replace(PLATFORM_TUNING, scale_up_after_s=6))
    assert result.full_world_s is not None, "\n".join(result.warnings)
    assert result.restarts <= 2, "\n".join(result.warnings)
    sizes = [e["world_size"] for e in events(tmp_path, "rendezvous")]
    assert sizes == sorted(sizes) and sizes[-1] == 4  # the world only grew


def test_an_agent_started_while_etcd_is_down_waits_and_a_second_joins_it(tmp_path):
    etcd = LocalEtcd()
    args = trainer_args(tmp_path, 400_000)
    agents = [Agent("a", etcd.endpoint, "etcd-late", tmp_path, args, max_nodes=2)]
    try:
        time.sleep(15)  # etcd is away for its first 15 s
        assert agents[0].proc.poll() is None, agents[0].output()[-3000:]
        etcd.start()
        agents.append(Agent("b", etcd.endpoint, "etcd-late", tmp_path, args, max_nodes=2))
        wait_until(lambda: [e for e in events(tmp_path, "step") if e["world_size"] == 2], "both training",
                   240, agents)
        assert "etcd is unreachable" in agents[0].output()
    finally:
        for agent in agents:
            agent.stop()
        etcd.__exit__()


def test_a_scale_up_keeps_the_survivors_workers_and_loses_no_step(tmp_path, etcd_module):
    """Beyond torchrun: the running members' workers stay up through an admission. They stop at
    one step, leave their process group, and join the bigger round in place; only the newcomer
    starts a worker, and it receives the state from a survivor: nobody reads a checkpoint."""
    args = trainer_args(tmp_path, 400_000)
    agents = [Agent(name, etcd_module, "in-place", tmp_path, args, max_nodes=4) for name in "ab"]
    try:
        wait_until(lambda: len([e for e in events(tmp_path, "step") if e["world_size"] == 2]) >= 20,
                   "two nodes training", 120, agents)
        workers = {agent.name: agent.worker_pids() for agent in agents}
        # Every checkpoint moved away: a member that read one would find none and start at step 0.
        checkpoints = tmp_path / "checkpoints"
        hidden = tmp_path / "hidden-checkpoints"
        hidden.mkdir()
        for path in checkpoints.glob("step-*.pt"):
            path.rename(hidden / path.name)
        joined_at = time.time()
        agents.append(Agent("c", etcd_module, "in-place", tmp_path, args, max_nodes=4))
        wait_until(lambda: [e for e in events(tmp_path, "step") if e["world_size"] == 3], "three nodes training",
                   120, agents)
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
        agents.append(Agent("d", etcd_module, "in-place", tmp_path, args, max_nodes=4))
        wait_until(lambda: [e for e in events(tmp_path, "step") if e["world_size"] == 4], "four nodes training",
                   120, agents)
        assert {agent.name: agent.worker_pids() for agent in agents[:3]} == workers
        for agent in agents:
            assert "did not pause" not in agent.output(), agent.output()[-3000:]
    finally:
        for agent in agents:
            agent.stop()
