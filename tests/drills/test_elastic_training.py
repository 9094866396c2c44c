"""Real agents (the pod's launcher, CPU, gloo) with a real etcd: a node dies, a node joins, a node is told to stop.

One job runs through all three events and is compared with an uninterrupted run of the same
config. Each agent is its own process group, so killing the group is what losing a pod does.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.drill_harness import paced
from trainctl.backends.local_cluster import Agent, read_events, wait_until
from training.contract import EXIT_MEMBERSHIP_CHANGE

pytestmark = pytest.mark.timeout(300)

# 800 steps in two epochs. The elastic job is held to 100 steps/s at two nodes (50 alone): from the kill
# (near step 60) the survivor alone needs 15 s to finish, and C joined 6 s after the kill here, so a C
# that starts twice as slowly still joins before the end. Unpaced, the survivor trained 175 steps/s alone,
# so the job had to be 2,500 steps, and the uninterrupted run trained them all (15 s); pacing sleeps, it
# changes no number.
SAMPLES = 12_800
GLOBAL_BATCH = 32
EPOCHS = 2
INTERVAL = 25
STEPS = EPOCHS * SAMPLES // GLOBAL_BATCH


def trainer_args(work: Path) -> list[str]:
    return [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=10",
        f"--data.synthetic_samples={SAMPLES}", "--data.num_workers=0",
        f"--train.global_batch_size={GLOBAL_BATCH}", "--train.micro_batch_size=16", f"--train.epochs={EPOCHS}",
        "--train.precision=fp32", "--train.log_every_steps=5", "--optim.lr=0.05",
        f"--checkpoint.dir={work}/checkpoints", f"--checkpoint.interval_steps={INTERVAL}", "--checkpoint.keep_last=3",
        f"--metrics.jsonl_path={work}/metrics.jsonl", f"--metrics.sample_log_dir={work}/samples",
    ]


def wait_for(predicate, what: str, agents: list[Agent]):
    return wait_until(predicate, what, timeout=90, agents=agents)


def steps_at(work: Path, world_size: int, after: float = 0.0) -> list[dict]:
    return [e for e in read_events(work / "metrics.jsonl")
            if e["event"] == "step" and e["world_size"] == world_size and e["time"] > after]


def trained_steps(work: Path) -> int:
    """The highest step any rank finished, from the per-step sample logs."""
    steps = [json.loads(line)["step"] for f in (work / "samples").glob("*.jsonl") for line in f.read_text().splitlines()]
    return max(steps) + 1 if steps else 0


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory, request):
    """kill B (2 -> 1 node), start C (1 -> 2), SIGTERM C (2 -> 1), finish on A."""
    etcd = request.getfixturevalue("etcd_module")
    work = tmp_path_factory.mktemp("elastic")
    args = trainer_args(work) + paced(100, 2)  # each node's share of 100 steps/s
    a = Agent("a", etcd, "elastic-test", work, args, max_restarts=20)
    b = Agent("b", etcd, "elastic-test", work, args, max_restarts=20)
    agents = [a, b]
    record: dict = {"work": work}
    try:
        wait_for(lambda: len(steps_at(work, 2)) >= 12, "two nodes training", agents)
        record["steps_before_kill"] = trained_steps(work)
        record["killed_at"] = b.kill_node()
        wait_for(lambda: steps_at(work, 1, record["killed_at"]), "the survivor training alone", agents)
        c = Agent("c", etcd, "elastic-test", work, args, max_restarts=20)
        agents.append(c)
        joined = wait_for(lambda: steps_at(work, 2, record["killed_at"]), "the third node joining", agents)
        record["joined_at"] = joined[0]["time"]
        wait_for(lambda: len(steps_at(work, 2, record["killed_at"])) >= 8, "two nodes training again", agents)
        record["steps_before_term"] = trained_steps(work)
        record["terminated_at"] = c.terminate()
        record["c_exit"] = c.wait(timeout=60)
        record["c_output"] = c.output()
        record["a_exit"] = a.wait(timeout=240)
        record["a_output"] = a.output()
    finally:
        for agent in agents:
            agent.stop()
    return record


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory, etcd_module):
    work = tmp_path_factory.mktemp("uninterrupted")
    agent = Agent("solo", etcd_module, "uninterrupted-test", work, trainer_args(work), max_nodes=1)
    try:
        assert agent.wait(timeout=240) == 0, agent.output()[-3000:]
    finally:
        agent.stop()
    return work


def final_checkpoint(work: Path) -> dict:
    last = sorted((work / "checkpoints").glob("step-*.pt"))[-1]
    return torch.load(last, weights_only=True)


def events(work: Path, kind: str) -> list[dict]:
    return [e for e in read_events(work / "metrics.jsonl") if e["event"] == kind]


def test_the_job_finishes_through_a_kill_a_join_and_a_sigterm(elastic_run):
    assert elastic_run["a_exit"] == 0, elastic_run["a_output"][-3000:]
    assert final_checkpoint(elastic_run["work"])["progress"]["step"] == STEPS
    worlds = [e["world_size"] for e in events(elastic_run["work"], "rendezvous")]
    # 2 nodes, the survivor alone, 2 again with the newcomer, alone after the SIGTERM.
    assert worlds[0] == 2 and worlds[-1] == 1
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [2, 1, 2, 1]


def node_ranks(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.startswith('{"event": "node_ranks"')]


def test_each_agent_says_which_ranks_its_node_holds_after_every_round(elastic_run):
    """`trainctl logs --rank` reads these lines: a pod's index is not its rank once the job regrouped."""
    a, c = node_ranks(elastic_run["a_output"]), node_ranks(elastic_run["c_output"])
    assert a[0]["group_world_size"] == 2 and a[-1] == {**a[-1], "group_world_size": 1, "global_ranks": [0]}
    shared = [e for e in a if e["time"] > elastic_run["killed_at"] and e["group_world_size"] == 2]
    assert c and shared and c[0]["group_world_size"] == 2
    # The round C joined: the two nodes hold ranks 0 and 1 between them, each exactly once.
    assert sorted(shared[0]["global_ranks"] + c[0]["global_ranks"]) == [0, 1]
    assert {shared[0]["group_rank"], c[0]["group_rank"]} == {0, 1}


def test_the_survivor_goes_on_from_memory_and_trains_no_step_again(elastic_run):
    """The kill lands between two checkpoints. Before, the survivor restarted its workers and went
    back to the newest checkpoint (12 to 20 steps trained again here); now it keeps its state and
    goes on from the step it had reached, reading no checkpoint."""
    work = elastic_run["work"]
    resume = next(e for e in events(work, "resume") if e["time"] > elastic_run["killed_at"])
    saved_before_kill = [e["step"] for e in events(work, "checkpoint_saved") if e["time"] < elastic_run["killed_at"]]
    assert resume["step"] > max(saved_before_kill)  # between two checkpoints: the drill shows something
    assert resume["checkpoint"] is None and resume["bytes_read"] == 0 and resume["bytes_from_peer"] > 0
    # The steps the two-node round logged: every one of them completed by the survivor is kept; the
    # most it logged beyond is the step in flight at the kill, which counts once, after the resume.
    attempt = next(e for e in events(work, "rendezvous") if e["world_size"] == 2)["attempt"]
    logged = [json.loads(line)["step"] for f in (work / "samples").glob(f"samples-{attempt}-*.jsonl")
              for line in f.read_text().splitlines()]
    assert resume["step"] >= max(logged) >= resume["step"] - 1
    assert "joined round 1 in place (no restart, recovery after a lost peer)" in elastic_run["a_output"]


def test_sigterm_checkpoints_first_so_no_step_is_lost(elastic_run):
    work = elastic_run["work"]
    stop = next(e for e in events(work, "stop") if e["time"] > elastic_run["terminated_at"])
    resume = next(e for e in events(work, "resume") if e["time"] > stop["time"])
    assert resume["step"] == stop["step"] >= elastic_run["steps_before_term"]
    assert elastic_run["c_exit"] != 0  # the agent itself was signalled
    assert f"exitcode: {EXIT_MEMBERSHIP_CHANGE}" in elastic_run["a_output"]  # the peer restarted, not finished


def test_counted_steps_cover_every_sample_once_per_epoch(elastic_run):
    work = elastic_run["work"]
    history = final_checkpoint(work)["progress"]["history"]
    counted = {(attempt, step) for attempt, first, end in history for step in range(first, end)}
    assert len(counted) == STEPS  # the segments tile the run: no step counted twice or missing
    seen: dict[int, Counter] = {epoch: Counter() for epoch in range(EPOCHS)}
    for log in (work / "samples").glob("*.jsonl"):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if (record["attempt"], record["step"]) in counted:
                seen[record["epoch"]].update(record["ids"])
    for epoch, counts in seen.items():
        assert set(counts) == set(range(SAMPLES)), f"epoch {epoch}: samples missing"
        assert set(counts.values()) == {1}, f"epoch {epoch}: samples seen twice"
    assert len(history) >= 4  # one segment per attempt that checkpointed


def test_the_result_matches_an_uninterrupted_run(elastic_run, uninterrupted_run):
    elastic_state = final_checkpoint(elastic_run["work"])
    solo_state = final_checkpoint(uninterrupted_run)
    elastic_loss = events(elastic_run["work"], "step")[-1]["loss"]
    solo_loss = events(uninterrupted_run, "step")[-1]["loss"]
    assert elastic_loss == pytest.approx(solo_loss, rel=0.05, abs=0.01)
    for name, tensor in solo_state["model"].items():
        assert torch.allclose(elastic_state["model"][name], tensor, atol=1e-3), name
