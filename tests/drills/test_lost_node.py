"""A lost node costs the survivors no step (issue 49): real agents, a real etcd, CPU and gloo.

The survivors' collectives fail, they keep their state, the round re-forms without the dead
node, and the survivor furthest along hands its state to the others over the new group: nobody
reads the checkpoint folder and no step is trained again, wherever the kill lands. The figures at
2, 8 and 16 agents are benchmarks/elastic_recovery.py --lost-node's (docs/elasticity-and-checkpoints.md).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.drill_harness import EVAL_EVERY, MOMENTS, events, lost_node_drill, trainer_args
from trainctl.backends.local_cluster import Agent, wait_until
from training.loop.trainer import RAISE_AT_STEP_ENV

pytestmark = pytest.mark.timeout(600)


def test_a_node_killed_during_a_checkpoint_write_costs_four_agents_no_step(tmp_path):
    result = lost_node_drill(tmp_path, 4, MOMENTS[1])
    assert result.steps_again == 0
    assert result.resumed_from == "memory" and result.bytes_read == 0
    assert result.write_landed  # the write in flight was rank 0's, which survived: it lands


def test_a_node_killed_during_an_evaluation_costs_no_step_and_the_evaluation_runs_once(tmp_path):
    result = lost_node_drill(tmp_path, 3, MOMENTS[2])
    assert result.steps_again == 0 and result.resumed_from == "memory"
    assert result.evaluation_again


def test_a_peer_that_stops_answering_without_closing_its_connections_costs_no_step(tmp_path, etcd_module):
    """A node that freezes (SIGSTOP: no connection reset, as after a power loss or a partition) leaves
    the survivors blocked in a collective until distributed.timeout_s (120 s on CPU). Its lease ends;
    the agents signal their workers (LOST_PEER_SIGNAL), whose watcher thread shuts the round's
    connections: the collectives fail at once and the survivors go on from memory."""
    args = [*trainer_args(tmp_path, 400_000), "--train.log_every_steps=1"]
    agents = [Agent(name, etcd_module, "frozen-peer", tmp_path, args, max_nodes=3) for name in "abc"]
    try:
        wait_until(lambda: len([e for e in events(tmp_path, "step") if e["world_size"] == 3]) >= 20,
                   "three nodes training", 180, agents)
        victim = next(a for a in reversed(agents) if '"event": "step"' not in a.output())
        frozen_at = time.time()
        os.killpg(victim.proc.pid, signal.SIGSTOP)
        first = wait_until(lambda: [e for e in events(tmp_path, "step") if e["time"] > frozen_at
                                    and e["world_size"] == 2], "the survivors training", 100, [])[0]
        resume = next(e for e in events(tmp_path, "resume") if e["time"] > frozen_at)
        outputs = [a.output() for a in agents if a is not victim]
    finally:
        os.killpg(victim.proc.pid, signal.SIGKILL)
        for agent in agents:
            agent.stop()
    assert resume["checkpoint"] is None and resume["bytes_read"] == 0
    assert first["time"] - frozen_at < 60  # not the collectives' 120 s timeout
    assert all("joined round 1 in place (no restart, recovery after a lost peer)" in out for out in outputs)
    assert any("the process group is broken (the agent reports a lost peer)" in out for out in outputs)


# The step of the worker's own error below: before the first evaluation (EVAL_EVERY), after the first checkpoint.
OWN_ERROR_STEP = 40


def test_a_workers_own_error_is_not_a_lost_peer_and_a_sigterm_during_an_evaluation_stops_every_rank_at_its_step(
        tmp_path, etcd_module):
    """Two ends of a worker that are not a lost node, in one two-node job (one job for both: each agent's start
    costs about 6.5 core-seconds, and both need the same two nodes with evaluations).

    First a RuntimeError of the job's own (not a dead peer), which also breaks the collectives. With no lost peer
    to re-form without, its agent tells the worker so, and it fails with its error and restarts, as after any
    failure. (The other node's worker either is told the same, or, once the failed worker's restart has started
    a new round, keeps its state and hands it to the restarted one.)

    Then a SIGTERM reaches one node's workers during an evaluation; the other's learn of it inside the evaluation
    (its few-batch agreement), so both leave it for the stop checkpoint at that step, and the survivor evaluates
    there once it resumes alone."""
    args = [a for a in trainer_args(tmp_path, 400_000) if a != "--eval.enabled=false"]
    args += [f"--eval.every_steps={EVAL_EVERY}", "--eval.synthetic_samples=200000", "--eval.batch_size=512",
             "--train.log_every_steps=1"]
    fault = {RAISE_AT_STEP_ENV: f"{OWN_ERROR_STEP}:{tmp_path}/fault-raised"}
    agents = [Agent("a", etcd_module, "own-error-then-stop", tmp_path, args, max_nodes=2),
              Agent("b", etcd_module, "own-error-then-stop", tmp_path, args, max_nodes=2, env=fault)]
    try:
        wait_until(lambda: (tmp_path / "fault-raised").exists(), "the fault", 180, agents)
        raised_at = time.time()
        wait_until(lambda: [e for e in events(tmp_path, "step") if e["time"] > raised_at and e["world_size"] == 2],
                   "training again", 180, agents)
        faulty = agents[1].output()

        step = wait_until(lambda: [e for e in events(tmp_path, "step") if e["time"] > raised_at
                                   and e["world_size"] == 2 and e["step"] % EVAL_EVERY == 0],
                          "an evaluation starting", 180, agents, poll=0.02)[0]
        time.sleep(0.3)
        terminated = agents[1].terminate()
        assert agents[1].wait(timeout=60) != 0
        resumed = wait_until(lambda: [e for e in events(tmp_path, "resume") if e["time"] > terminated], "the resume",
                             120, agents[:1])[0]
        evaluated = wait_until(lambda: [e for e in events(tmp_path, "eval") if e["step"] == step["step"]],
                               "the evaluation again", 120, agents[:1])
    finally:
        for agent in agents:
            agent.stop()
    assert f"injected fault at step {OWN_ERROR_STEP}" in faulty
    assert "and no peer was lost; it fails with that error" in faulty
    assert "joined round 1 in place" not in faulty  # restarted, not moved with a state
    resume = next(e for e in events(tmp_path, "resume") if e["time"] > raised_at)
    # Nothing before the newest checkpoint is trained again. Which step that is depends on the write's
    # timing: the save policy starts a write early enough to land by the interval (its write lead,
    # training/loop/save_policy.py), so on a loaded machine the first save can be step 24, not 25.
    newest = max(e["step"] for e in events(tmp_path, "checkpoint_saved") if e["time"] < raised_at)
    assert newest > 0 and resume["step"] >= newest

    stop = next(e for e in events(tmp_path, "checkpoint_started") if e["time"] > terminated)
    assert stop["reason"] == "stop" and stop["step"] == step["step"] == resumed["step"]
    assert len(evaluated) == 1 and evaluated[0]["time"] > resumed["time"] and evaluated[0]["samples"] == 200_000
