"""A checkpoint counts when it is on disk: ``checkpoint_saved`` says so, a kill never costs more
than one interval, and a trainer that loses a peer mid-write finishes the write before it goes.
Two real agents on a real etcd, with a file system made slow (each write sleeps before its rename).

These are the guarantees of the restart from a checkpoint after a lost peer, which NCCL workers
take (docs/DESIGN.md, "Recovery from memory"): the agents run with PLATFORM_REGROUP_IN_PLACE=0,
under which gloo workers take it too. With recovery from memory a kill costs no step at all
(tests/drills/test_lost_node.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from training.contract import REGROUP_IN_PLACE_ENV
from training.loop.checkpoint import SLOW_WRITE_ENV
from trainctl.backends.local_cluster import Agent, read_events, wait_until

pytestmark = pytest.mark.timeout(400)
RESTART_FROM_CHECKPOINT = {REGROUP_IN_PLACE_ENV: "0"}


def trainer_args(work: Path, interval: int) -> list[str]:
    return [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=4", "--data.synthetic_samples=2000000",
        "--data.num_workers=0", "--train.global_batch_size=16", "--train.micro_batch_size=8", "--train.epochs=1",
        "--train.precision=fp32", "--train.log_every_steps=1", f"--checkpoint.dir={work}/checkpoints",
        f"--checkpoint.interval_steps={interval}", "--checkpoint.keep_last=3",
        f"--metrics.jsonl_path={work}/metrics.jsonl", f"--metrics.sample_log_dir={work}/samples",
    ]


def events(work: Path, kind: str, after: float = 0.0) -> list[dict]:
    return [e for e in read_events(work / "metrics.jsonl") if e["event"] == kind and e["time"] > after]


def writing(work: Path, after: float = 0.0) -> dict | None:
    """The asynchronous save in flight now (started, not yet announced), if any."""
    saved = {e["step"] for e in events(work, "checkpoint_saved")}
    started = [e for e in events(work, "checkpoint_started", after) if e["asynchronous"]]
    return started[-1] if started and started[-1]["step"] not in saved else None


def rank_zero(agents: list[Agent]) -> Agent:
    """The agent whose worker reports (rank 0 writes the metrics, to its pod's log too)."""
    return next(a for a in agents if '"event": "checkpoint_started"' in a.output())


def trained_steps(work: Path) -> int:
    import json

    steps = [json.loads(line)["step"] for f in (work / "samples").glob("*.jsonl") for line in f.read_text().splitlines()]
    return max(steps) + 1 if steps else 0


def test_a_kill_of_rank_0s_node_mid_write_costs_at_most_one_interval(tmp_path, etcd_module):
    interval = 20
    args = trainer_args(tmp_path, interval)
    slow = {SLOW_WRITE_ENV: "1.0", **RESTART_FROM_CHECKPOINT}
    agents = [Agent(name, etcd_module, "durable-kill", tmp_path, args, max_nodes=2, env=slow) for name in "ab"]
    try:
        wait_until(lambda: len(events(tmp_path, "checkpoint_saved")) >= 2 and writing(tmp_path),
                   "a write in flight after two durable ones", 180, agents)
        durable = max(e["step"] for e in events(tmp_path, "checkpoint_saved"))
        victim = rank_zero(agents)
        before = trained_steps(tmp_path)
        killed_at = victim.kill_node()
        survivor = next(a for a in agents if a is not victim)
        resume = wait_until(lambda: events(tmp_path, "resume", killed_at), "the survivor resuming", 120, [survivor])[0]
    finally:
        for agent in agents:
            agent.stop()
    assert resume["step"] == durable  # the newest announced checkpoint, not the one being written
    assert 0 < before - resume["step"] <= interval
    # Throughout, rank 0 never trained more than one interval past the newest checkpoint on disk.
    marks = sorted([(e["time"], e["step"]) for e in events(tmp_path, "checkpoint_saved")]
                   + [(e["time"], e["step"]) for e in events(tmp_path, "start") + events(tmp_path, "resume")])
    for step in events(tmp_path, "step"):
        newest = max(s for t, s in marks if t <= step["time"])
        assert step["step"] - newest <= interval, step


def test_a_trainer_that_loses_a_peer_mid_write_finishes_the_write_first(tmp_path, etcd_module):
    interval = 400  # a write (2 s) fits well inside an interval: rank 0 trains on while it writes
    args = trainer_args(tmp_path, interval)
    agents = [Agent(name, etcd_module, "durable-peer", tmp_path, args, max_nodes=2,
                    env={SLOW_WRITE_ENV: "2.0", **RESTART_FROM_CHECKPOINT}) for name in "ab"]
    try:
        wait_until(lambda: events(tmp_path, "checkpoint_saved"), "the first checkpoint", 180, agents)
        first = events(tmp_path, "checkpoint_saved")[-1]["time"]
        in_flight = wait_until(lambda: writing(tmp_path, first), "the next write in flight", 180, agents)
        # Rank 0 is training, in collectives, while its writer thread writes.
        wait_until(lambda: events(tmp_path, "step", in_flight["time"] + 0.3), "training during the write", 30, agents)
        owner = rank_zero(agents)
        peer = next(a for a in agents if a is not owner)
        killed_at = peer.kill_node()
        saved = wait_until(lambda: [e for e in events(tmp_path, "checkpoint_saved", killed_at)
                                    if e["step"] == in_flight["step"]], "the write in flight to finish", 60, [owner])
        resume = wait_until(lambda: events(tmp_path, "resume", killed_at), "the survivor resuming", 120, [owner])[0]
        time.sleep(1)
        output = owner.output()
    finally:
        for agent in agents:
            agent.stop()
    assert (tmp_path / "checkpoints" / Path(saved[0]["path"]).name).exists()
    assert resume["step"] == in_flight["step"]  # nothing lost that was being written
    assert "waiting up to" in output and "terminate called" not in output
