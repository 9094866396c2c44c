"""Failure drills on the local cluster: what a job on EKS lives through, replayed on loopback.

Each drill runs real agents (``python -m training.launcher``, each its own process group, as a
pod is) against a real etcd, does to them what a cluster does (lose a node, drain one, lose
etcd for a while, restart it with or without its data, replace a failed pod, restart the whole
job, schedule a pod after the end), and returns what happened, measured. The tests assert on
these records; ``benchmarks/elastic_recovery.py`` prints them as the cost table in docs/elasticity-and-checkpoints.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainctl.backends.local_cluster import Agent, LocalEtcd, LocalEtcdCluster, read_events, wait_until

GLOBAL_BATCH = 32
INTERVAL = 25  # checkpoint interval of the drills, in steps


def trainer_args(work: Path, samples: int, epochs: int = 1) -> list[str]:
    """A small MLP whose every step logs the sample ids it trained on. No validation: the drills
    are about membership and checkpoints (tests/drills/test_evaluation_runs.py covers evaluation's resumes)."""
    return [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=10", "--eval.enabled=false",
        f"--data.synthetic_samples={samples}", "--data.num_workers=0",
        f"--train.global_batch_size={GLOBAL_BATCH}", "--train.micro_batch_size=16", f"--train.epochs={epochs}",
        "--train.precision=fp32", "--train.log_every_steps=5", "--optim.lr=0.05",
        f"--checkpoint.dir={work}/checkpoints", f"--checkpoint.interval_steps={INTERVAL}", "--checkpoint.keep_last=3",
        f"--metrics.jsonl_path={work}/metrics.jsonl", f"--metrics.sample_log_dir={work}/samples",
    ]


def paced(steps_per_s: float | None, nodes: int) -> list[str]:
    """The trainer override that holds a job of ``nodes`` single-rank nodes to ``steps_per_s``
    (data.synthetic_samples_per_s), none for None: a drill sized from its plan then lasts as planned
    on a fast machine and a slow one alike, and leaves the cores it does not need idle."""
    return [f"--data.synthetic_samples_per_s={steps_per_s * GLOBAL_BATCH / nodes:g}"] if steps_per_s else []


def events(work: Path, kind: str | None = None) -> list[dict]:
    found = read_events(work / "metrics.jsonl")
    return [e for e in found if kind is None or e["event"] == kind]


def trained_steps(work: Path) -> int:
    """The highest step any rank finished, from the per-step sample logs."""
    steps = [json.loads(line)["step"] for f in (work / "samples").glob("*.jsonl") for line in f.read_text().splitlines()]
    return max(steps) + 1 if steps else 0


def final_checkpoint(work: Path) -> dict:
    import torch

    last = sorted((work / "checkpoints").glob("step-*.pt"))[-1]
    return torch.load(last, weights_only=True)


def sample_coverage(work: Path, samples: int, epochs: int) -> tuple[int, dict[int, Counter]]:
    """(counted steps, per-epoch sample counts over the counted steps) from the final checkpoint's history."""
    history = final_checkpoint(work)["progress"]["history"]
    counted = {(attempt, step) for attempt, first, end in history for step in range(first, end)}
    seen: dict[int, Counter] = {epoch: Counter() for epoch in range(epochs)}
    for log in (work / "samples").glob("*.jsonl"):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if (record["attempt"], record["step"]) in counted:
                # A sample that could not be read counts as seen: it was skipped exactly once.
                seen[record["epoch"]].update(record["ids"] + record.get("skipped", []))
    return len(counted), seen


def every_sample_once(work: Path, samples: int, epochs: int = 1) -> bool:
    steps, seen = sample_coverage(work, samples, epochs)
    return steps == epochs * samples // GLOBAL_BATCH and all(
        set(counts) == set(range(samples)) and set(counts.values()) == {1} for counts in seen.values())


@dataclass
class Disruption:
    """One thing done to a running job, and what it cost."""

    what: str
    at: float
    lasted_s: float = 0.0
    steps_during: int = 0  # steps the job trained while it lasted
    steps_lost: int = 0  # steps trained before it and trained again after
    restarts: int = 0  # re-rendezvous rounds it caused
    stalled_s: float = 0.0  # longest gap between step lines from its start to 20 s after it


@dataclass
class DrillResult:
    work: Path
    exit_codes: dict[str, int] = field(default_factory=dict)
    disruptions: list[Disruption] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)


def _steps_between(work: Path, start: float, end: float) -> list[dict]:
    return [e for e in events(work, "step") if start <= e["time"] <= end]


def _steps_at(work: Path, after: float, world_size: int) -> list[dict]:
    return [e for e in events(work, "step") if e["time"] > after and e["world_size"] == world_size]


def _stall(work: Path, start: float, end: float) -> float:
    """The longest time without a step line from ``start`` on, up to ``end`` or now, whichever is first."""
    end = min(end, time.time())
    times = [start] + [e["time"] for e in _steps_between(work, start, end)]
    return max((b - a for a, b in itertools.pairwise(times)), default=end - start)


def sample_records(work: Path) -> list[dict]:
    return [json.loads(line) for f in (work / "samples").glob("*.jsonl") for line in f.read_text().splitlines()]


def _training_at_full_size(work: Path, world_size: int) -> bool:
    """Ten step lines at ``world_size``. Agents may start at 1 node (--nnodes=1:N): on a loaded machine a
    slow one is admitted in a round of its own a few seconds later, which a disruption begun before it
    would be charged with (a CI run counted that admission as a restart of the etcd outage)."""
    return len([e for e in events(work, "step") if e["world_size"] == world_size]) >= 10


def _regroup(work: Path, item: Disruption, world_size: int, what: str, agents: list, result) -> None:
    """Wait for ``item``'s new round of ``world_size`` and its first step, then account for it."""
    wait_until(lambda: [e for e in events(work, "rendezvous") if e["time"] > item.at
                        and e["world_size"] == world_size], what, 120, agents)
    item.lasted_s = time.time() - item.at
    wait_until(lambda: _steps_at(work, item.at, world_size=world_size), f"{what}: training", 120, agents)
    _account(work, item)
    result.disruptions.append(item)


def _account(work: Path, item: Disruption) -> None:
    """Fill in the cost of ``item``: steps trained meanwhile, restarts, steps lost, the longest stall."""
    end = item.at + item.lasted_s
    window = [e["step"] for e in _steps_between(work, item.at, end)]
    item.steps_during = max(window) - min(window) if len(window) > 1 else 0
    rounds = [e for e in events(work, "rendezvous") if item.at < e["time"] < end + 20]
    item.restarts = len(rounds)
    if rounds:
        new_attempts = {r["attempt"] for r in rounds}
        before = max((r["step"] + 1 for r in sample_records(work) if r["attempt"] not in new_attempts), default=0)
        resume = next(e for e in events(work, "resume") if e["time"] > item.at)
        item.steps_lost = max(0, before - resume["step"])
    item.stalled_s = _stall(work, item.at, end + 20)


def _settle(work: Path, item: Disruption, result: DrillResult) -> None:
    """``item`` is over: give a re-rendezvous, if any, time to happen, then account for it."""
    item.lasted_s = time.time() - item.at
    time.sleep(6)
    _account(work, item)
    result.disruptions.append(item)


def _wait_for_exits(agents: list[Agent], result: DrillResult) -> None:
    for agent in agents:
        result.exit_codes[agent.name] = agent.wait(timeout=900)


def _stop(agents: list[Agent], result: DrillResult) -> None:
    for agent in agents:
        agent.stop()
        result.outputs[agent.name] = agent.output()


def etcd_drill(work: Path, plan: list[tuple[str, float]], samples: int = 1_000_000, nodes: int = 2,
               steps_per_s: float | None = None) -> DrillResult:
    """Two nodes train while etcd goes away and comes back as ``plan`` says.

    ``plan`` items: ("down", seconds) etcd killed, back on its data after that long;
    ("restart", 0) killed and restarted at once on its data; ("empty", 0) restarted without its
    data; ("wait", seconds) nothing happens. ``steps_per_s``: the job's pace (:func:`paced`).
    """
    work.mkdir(parents=True, exist_ok=True)
    result = DrillResult(work)
    etcd = LocalEtcd()
    endpoint = etcd.start()
    args = trainer_args(work, samples) + paced(steps_per_s, nodes)
    # max_nodes: the first round completes when the last node joins, not a last call (2 s) later.
    agents = [Agent(name, endpoint, "etcd-drill", work, args, max_nodes=nodes, max_restarts=20)
              for name in "ab"[:nodes]]
    try:
        wait_until(lambda: _training_at_full_size(work, nodes), "training", 120, agents)
        for kind, seconds in plan:
            item = Disruption(f"etcd {kind}" + (f" {seconds:.0f} s" if kind == "down" else ""), time.time())
            if kind == "down":
                etcd.stop()
                time.sleep(seconds)
                etcd.start()
            elif kind in ("restart", "empty"):
                etcd.stop()
                etcd.start(empty=kind == "empty")
            else:
                time.sleep(seconds)
                continue
            _settle(work, item, result)
        _wait_for_exits(agents, result)
    finally:
        _stop(agents, result)
        etcd.__exit__()
    return result


def quorum_drill(work: Path, plan: list[tuple[str, float]], samples: int = 1_000_000, nodes: int = 4,
                 steps_per_s: float | None = None) -> DrillResult:
    """``nodes`` nodes train against three etcd members while members go away as ``plan`` says.

    ``plan`` items: ("leader", seconds) or ("follower", seconds): that member is SIGKILLed and
    comes back on its data after that long, as a StatefulSet pod rescheduled onto its volume
    does; ("wait", seconds) nothing happens. The agents are given every member's address, as
    the pods are. ``steps_per_s``: the job's pace (:func:`paced`).
    """
    work.mkdir(parents=True, exist_ok=True)
    result = DrillResult(work)
    cluster = LocalEtcdCluster(3)
    endpoints = cluster.__enter__()
    args = trainer_args(work, samples) + paced(steps_per_s, nodes)
    agents = [Agent(f"n{i}", endpoints, "quorum-drill", work, args, min_nodes=nodes, max_nodes=nodes, max_restarts=20)
              for i in range(nodes)]
    try:
        wait_until(lambda: _training_at_full_size(work, nodes), "training", 180, agents)
        for kind, seconds in plan:
            if kind == "wait":
                time.sleep(seconds)
                continue
            leader = cluster.leader()
            member = leader if kind == "leader" else next(m for m in cluster.members if m is not leader)
            item = Disruption(f"etcd {kind} lost {seconds:.0f} s", member.stop())
            time.sleep(seconds)
            member.start()
            _settle(work, item, result)
        _wait_for_exits(agents, result)
    finally:
        _stop(agents, result)
        cluster.__exit__()
    return result


def incarnation_drill(work: Path, samples: int = 120_000, steps_per_s: float | None = None) -> DrillResult:
    """An agent's workers crash in a loop, a replacement pod rejoins, the job restarts afresh, a pod comes after the end.

    What Volcano does is played by hand: the replacement of a failed pod keeps the job version
    (the same rendezvous id); the whole-job restart bumps it (a new id); the late pod has the
    finished incarnation's id. ``steps_per_s``: the first version's pace at two nodes (:func:`paced`; alone,
    half of it); the new version trains unpaced.
    """
    work.mkdir(parents=True, exist_ok=True)
    result = DrillResult(work)
    args = trainer_args(work, samples) + paced(steps_per_s, 2)
    # Each version of the job has two nodes (max_nodes=2): its first round completes when the second joins,
    # not a last call (2 s) later.
    with LocalEtcd() as endpoint:
        # Its first failure follows progress and costs no restart; the next, right at the start, does.
        fragile = Agent("a", endpoint, "job-v0", work, args, max_nodes=2, max_restarts=0)
        steady = Agent("b", endpoint, "job-v0", work, args, max_nodes=2, max_restarts=20)
        agents = [fragile, steady]
        try:
            wait_until(lambda: _training_at_full_size(work, 2), "training", 120, agents)
            failed = Disruption("a node's workers crash in a loop", time.time())
            result.exit_codes["a"] = fragile.crash_loop(timeout=120)
            _regroup(work, failed, 1, "the survivor alone", agents, result)

            replaced = Disruption("the failed pod's replacement rejoins", time.time())
            replacement = Agent("a2", endpoint, "job-v0", work, args, max_nodes=2, max_restarts=20)
            agents.append(replacement)
            _regroup(work, replaced, 2, "the replacement joining", agents, result)

            restarted = Disruption("the whole job restarts under a new version", time.time())
            for agent in (steady, replacement):
                agent.kill_node()  # Volcano's RestartJob deletes every pod of the old version
            # Unpaced: the new version's rounds wait on nothing but its own steps.
            fresh = [Agent(name, endpoint, "job-v1", work, trainer_args(work, samples), max_nodes=2, max_restarts=20)
                     for name in ("c", "d")]
            agents += fresh
            wait_until(lambda: [e for e in events(work, "resume") if e["time"] > restarted.at], "the new version",
                       120, agents)
            restarted.lasted_s = time.time() - restarted.at
            _account(work, restarted)
            result.disruptions.append(restarted)
            for agent in fresh:
                result.exit_codes[agent.name] = agent.wait(timeout=600)

            late = Disruption("a pod arrives after the end", time.time())
            straggler = Agent("e", endpoint, "job-v1", work, args, max_nodes=2, max_restarts=20)
            agents.append(straggler)
            result.exit_codes["e"] = straggler.wait(timeout=120)
            late.lasted_s = time.time() - late.at
            result.disruptions.append(late)
        finally:
            _stop(agents, result)
    return result


@dataclass
class ScaleResult:
    """What one wave of arrivals cost a job (:func:`scale_drill`)."""

    agents: int
    spread_s: float
    full_world_s: float | None = None  # from the first arrival to the first step at full size
    after_last_arrival_s: float | None = None  # from the last arrival to the first step at full size
    restarts: int = 0  # rounds after the first one, until full size
    steady_s: float = 0.0
    steady_rounds: int = 0  # rounds during the steady window (0: nothing restarted)
    writes_per_s: float = 0.0  # etcd Raft proposals committed a second during the steady window
    reads_per_s: float = 0.0  # etcd range requests a second during the steady window
    etcd_cpu_pct: float = 0.0  # of one core, during the steady window
    kill_to_step_s: float | None = None  # SIGKILL of one node -> first step of the smaller world
    # Per admission: from the last step of the smaller world to the first of the bigger one.
    growth_pauses_s: list[float] = field(default_factory=list)
    exit_codes: dict[str, int] = field(default_factory=dict)
    # The agents' warnings and errors (each prefixed with its agent's name): what a failed assertion prints.
    warnings: list[str] = field(default_factory=list)


def agent_warnings(agents: list[Agent]) -> list[str]:
    """The launcher's and the rendezvous' WARNING and ERROR lines of each agent, named by agent.
    The trainer's straggler lines are left out: on a shared machine they are many and explain nothing."""
    lines = []
    for agent in agents:
        for line in agent.output().splitlines():
            if (" WARNING training.launcher" in line or " ERROR training.launcher" in line
                    or " WARNING training.loop.regroup" in line or " WARNING training.loop.trainer: a collective" in line):
                lines.append(f"{agent.name}: {line}")
    return lines


ETCD_COUNTERS = ("etcd_server_proposals_committed_total", "etcd_mvcc_range_total", "process_cpu_seconds_total")


def etcd_metrics(endpoint: str, names: tuple[str, ...] = ETCD_COUNTERS) -> dict[str, float]:
    """Some of etcd's Prometheus metrics (same port as the client API), each summed over its labels."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split(" ")[0].split("{")[0]
        if name in names and not line.startswith("#"):
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def scale_drill(work: Path, agents: int, spread_s: float = 0.0, steady_s: float = 30.0, kill: bool = True,
                tuning=None, samples: int = 2_000_000, timeout_s: float = 600,
                env: dict[str, str] | None = None, steps_per_s: float | None = None) -> ScaleResult:
    """``agents`` nodes arrive (at once, or evenly over ``spread_s``), train steadily for ``steady_s``,
    then one is SIGKILLed. Every agent runs the pod's command (``python -m training.launcher``).
    ``steps_per_s`` holds the full world to that pace (:func:`paced`; None: as fast as the cores allow)."""
    from training.contract import PLATFORM_TUNING

    work.mkdir(parents=True, exist_ok=True)
    result = ScaleResult(agents, spread_s)
    running: list[Agent] = []
    args = [*trainer_args(work, samples), "--train.log_every_steps=1",  # a step event for every step
            *paced(steps_per_s, agents)]
    with LocalEtcd() as endpoint:
        try:
            first = time.time()
            for index in range(agents):
                due = first + (spread_s * index / (agents - 1) if agents > 1 else 0)
                time.sleep(max(0.0, due - time.time()))
                running.append(Agent(f"n{index:02d}", endpoint, "scale", work, args, min_nodes=1, max_nodes=agents,
                                     max_restarts=100, tuning=tuning or PLATFORM_TUNING, env=env))
            last = time.time()
            full = wait_until(lambda: [e for e in events(work, "step") if e["world_size"] == agents],
                              f"a world of {agents}", timeout_s, running, poll=0.2)[0]
            result.full_world_s = round(full["time"] - first, 1)
            result.after_last_arrival_s = round(full["time"] - last, 1)
            rounds = [e for e in events(work, "rendezvous") if e["time"] <= full["time"]]
            result.restarts = len(rounds) - 1
            steps = events(work, "step")
            for round_ in rounds[1:]:
                before = [e["time"] for e in steps if e["time"] < round_["time"]]
                after = [e["time"] for e in steps if e["time"] > round_["time"]]
                if before and after:
                    result.growth_pauses_s.append(round(after[0] - before[-1], 2))
            before, at = etcd_metrics(endpoint), time.time()
            time.sleep(steady_s)
            after, result.steady_s = etcd_metrics(endpoint), time.time() - at
            result.steady_rounds = len([e for e in events(work, "rendezvous") if e["time"] > at])
            rate = {key: (after[key] - before[key]) / result.steady_s for key in after}
            result.writes_per_s = round(rate["etcd_server_proposals_committed_total"], 2)
            result.reads_per_s = round(rate["etcd_mvcc_range_total"], 1)
            result.etcd_cpu_pct = round(100 * rate["process_cpu_seconds_total"], 1)
            if kill:
                killed = running[-1].kill_node()
                step = wait_until(lambda: _steps_at(work, killed, agents - 1), "the smaller world's first step",
                                  timeout_s, running, poll=0.02)[0]
                result.kill_to_step_s = round(step["time"] - killed, 2)
        finally:
            for agent in running:
                agent.stop()
                result.exit_codes[agent.name] = agent.proc.returncode
            result.warnings = agent_warnings(running)
    return result


@dataclass
class LostNodeResult:
    """What losing one node cost a job of ``agents`` (:func:`lost_node_drill`)."""

    agents: int
    moment: str  # "between checkpoints", "during a checkpoint write" or "during an evaluation"
    in_place: bool  # the agents regroup in place (False: PLATFORM_REGROUP_IN_PLACE=0, torchrun's restarts)
    kill_to_step_s: float | None = None  # SIGKILL -> the first step of the smaller world
    steps_again: int | None = None  # steps rank 0 had finished at the kill that the job trained again
    resumed_from: str | None = None  # "memory" (a survivor's state) or the checkpoint file read
    bytes_read: int | None = None  # read from the checkpoint folder to resume
    evaluation_again: bool | None = None  # during an evaluation: it ran again at the same step
    write_landed: bool | None = None  # during a checkpoint write (rank 0's, which survives): it landed
    every_sample_once: bool | None = None  # until_finished: the counted steps trained each sample once
    exit_codes: dict[str, int] = field(default_factory=dict)


MOMENTS = ("between checkpoints", "during a checkpoint write", "during an evaluation")
EVAL_EVERY = 60  # steps, for the kill during an evaluation
SLOW_WRITE_S = "3"  # seconds each checkpoint write lasts, for the kill during one


def lost_node_drill(work: Path, agents: int, moment: str = MOMENTS[0], in_place: bool = True,
                    samples: int = 2_000_000, timeout_s: float = 600, device: str | None = None,
                    until_finished: bool = False, extra_args: tuple[str, ...] = ()) -> LostNodeResult:
    """``agents`` nodes train together; one (not rank 0's) is SIGKILLed at ``moment``. Measured: the
    time to the smaller world's first step, the steps trained again, and where the job resumed from.

    ``device="cuda"``: every node trains on the one GPU with NCCL. Each gets an NCCL_HOSTID of its own,
    so NCCL takes them for separate hosts (NCCL's "Duplicate GPU" check compares host hashes, which
    NCCL_HOSTID sets: nccl v2.27.7 src/misc/utils.cc, src/init.cc) and joins them with its socket
    transport over loopback, as nodes are joined by the network.

    ``until_finished``: the survivors then train the epoch of ``samples`` to its end, and the drill
    checks that the counted steps trained every sample once."""
    from training.contract import PLATFORM_TUNING, REGROUP_IN_PLACE_ENV
    from training.loop.checkpoint import SLOW_WRITE_ENV

    work.mkdir(parents=True, exist_ok=True)
    result = LostNodeResult(agents, moment, in_place)
    args = [*trainer_args(work, samples), "--train.log_every_steps=1"]
    if device:
        args.append(f"--train.device={device}")
    args += extra_args
    env = {} if in_place else {REGROUP_IN_PLACE_ENV: "0"}
    if device == "cuda":
        env.update(NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    if moment == MOMENTS[1]:
        env[SLOW_WRITE_ENV] = SLOW_WRITE_S
    if moment == MOMENTS[2]:
        # An evaluation of a few seconds every EVAL_EVERY steps (the drills' default has none).
        args = [a for a in args if a != "--eval.enabled=false"]
        args += [f"--eval.every_steps={EVAL_EVERY}", "--eval.synthetic_samples=200000", "--eval.batch_size=512"]
    # The shipped tuning, but a first round that waits for agents started seconds apart on a busy
    # machine: it completes as soon as all have joined (max_nodes), so the wait costs nothing otherwise.
    # With the 2 s default, the first agent once trained the whole job alone (the GPU check's lost-node case
    # on a loaded 2-core machine, 2026-11-27).
    first_round_together = replace(PLATFORM_TUNING, last_call_timeout=60.0)
    running: list[Agent] = []
    with LocalEtcd() as endpoint:
        try:
            for index in range(agents):
                node_env = {**env, "NCCL_HOSTID": f"lost-node-drill-{index}"} if device == "cuda" else env
                running.append(Agent(f"n{index:02d}", endpoint, "lost-node", work, args, min_nodes=1, max_nodes=agents,
                                     max_restarts=100, tuning=first_round_together, env=node_env))
            wait_until(lambda: len([e for e in events(work, "step") if e["world_size"] == agents]) >= 30,
                       f"a world of {agents} training", timeout_s, running, poll=0.2)
            wait_until(lambda: _kill_moment(work, moment), moment, timeout_s, running, poll=0.02)
            writing = [e["step"] for e in events(work, "checkpoint_started")][-1:]
            # Not rank 0's node: it writes the checkpoints (and reports; its log has the step lines).
            victim = next(a for a in reversed(running) if '"event": "step"' not in a.output())
            killed = victim.kill_node()
            trained = max(e["step"] for e in events(work, "step") if e["time"] <= killed)
            step = wait_until(lambda: _steps_at(work, killed, agents - 1), "the smaller world's first step",
                              timeout_s, running, poll=0.02)[0]
            result.kill_to_step_s = round(step["time"] - killed, 2)
            resume = next(e for e in events(work, "resume") if e["time"] > killed)
            result.steps_again = max(0, trained - resume["step"])
            result.resumed_from = "memory" if resume.get("checkpoint") is None else Path(resume["checkpoint"]).name
            result.bytes_read = resume.get("bytes_read")
            if moment == MOMENTS[1]:
                result.write_landed = bool(wait_until(
                    lambda: [e for e in events(work, "checkpoint_saved") if e["step"] == writing[0]],
                    "the write in flight at the kill", timeout_s, running, poll=0.2))
            if moment == MOMENTS[2]:  # the evaluation the kill interrupted runs once, at its step
                due = trained - trained % EVAL_EVERY
                wait_until(lambda: [e for e in events(work, "eval") if e["step"] == due], "the evaluation again",
                           timeout_s, running, poll=0.2)
                at_due = [e for e in events(work, "eval") if e["step"] == due]
                result.evaluation_again = len(at_due) == 1 and at_due[0]["time"] > resume["time"]
            if until_finished:
                wait_until(lambda: events(work, "finished"), "the end of the epoch", timeout_s, running, poll=0.2)
                result.every_sample_once = every_sample_once(work, samples)
        finally:
            for agent in running:
                agent.stop()
                result.exit_codes[agent.name] = agent.proc.returncode
    return result


def _kill_moment(work: Path, moment: str) -> bool:
    """Is it ``moment`` in the job now (judged from its metrics)?"""
    found = events(work)
    if moment == MOMENTS[1]:
        started = [e["step"] for e in found if e["event"] == "checkpoint_started"]
        saved = {e["step"] for e in found if e["event"] == "checkpoint_saved"}
        return bool(started) and started[-1] not in saved and started[-1] > 0
    steps = [e for e in found if e["event"] == "step"]
    if not steps:
        return False
    last = steps[-1]
    if moment == MOMENTS[2]:
        # The step report comes just before the evaluation at that step; it runs for seconds.
        return last["step"] % EVAL_EVERY == 0 and time.time() - last["time"] > 0.3
    # Halfway between two checkpoints, or a little later: a fast job's steps outrun the polling.
    return INTERVAL // 2 <= last["step"] % INTERVAL < INTERVAL - 4


# The drills' margin over the median. On 2 shared cores scheduling alone puts the slowest rank of a
# healthy window at up to 1.27 times the median with 64 px inputs (12 windows, 4 agents; 1.44 at the
# p99 of 108 windows with 16 px ones, 2026-11-27). A node held to a share of the CPU shows less than
# 1/share: the healthy ranks' own times are stretched too, by the four of them sharing 2 cores. With a
# spinning process beside the drill (2026-11-28): a quarter showed 1.8 to 1.9 (before the throttle kept
# its share, even a tenth showed only 1.4 to 1.9, and CI once named the node at the fifth window), 0.15 showed
# 3.4 to 3.8, a tenth 8 to 10. The shipped default (0.25) is for real nodes, each with cores of its own.
STRAGGLER_DRILL_MARGIN = 0.5


@dataclass
class StragglerResult:
    """What :func:`straggler_drill` saw: the slowed node's pod, and the straggler events before and after."""

    slowed_pod: str = ""
    slowed_at_step: int | None = None
    named_healthy: list[dict] = field(default_factory=list)  # straggler events before the slowdown
    named_slowed: list[dict] = field(default_factory=list)  # straggler events after it
    windows_to_name: int | None = None  # reports from the slowdown's start to the one naming it, that one included
    exit_codes: dict[str, int] = field(default_factory=dict)
    # policy="replace": the step the ranks replaced the node at, what the job did after, and its rates.
    replaced: dict | None = None  # the straggler_replaced event
    resume: dict | None = None  # the survivors' resume event of the round without the node
    steps_again: int | None = None  # steps trained before the node left that the survivors trained again
    healthy_rate: float | None = None  # samples/s per node, every node healthy
    without_rate: float | None = None  # samples/s per node, the job without the replaced node
    back_to_full_s: float | None = None  # from the node's exit to the first step with a fresh node in its place
    warnings: list[str] = field(default_factory=list)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def throttle(pids: list[int], stop: threading.Event, share: float = 0.25, period_s: float = 0.02) -> None:
    """Let ``pids`` run ``share`` of every ``period_s`` and stop them for the rest, as a cgroup's CPU
    quota does (cpu.max: a quota per period, then the group waits), until ``stop`` is set.

    The stop that ends a run comes late on a loaded machine (this thread waits for a core too), so each
    pause is sized from the run as it really was: the share holds however late the thread wakes. Sized
    from the intended run alone, on two busy cores a node asked down to a tenth slowed the job only 2×."""
    try:
        while not stop.is_set():
            resumed = time.monotonic()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            time.sleep(period_s * share)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            ran_s = time.monotonic() - resumed
            time.sleep(ran_s * (1 - share) / share)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def straggler_drill(work: Path, agents: int = 4, healthy_s: float = 20, slowed_s: float = 20,
                    log_every_steps: int = 20, share: float = 0.25, margin: float = STRAGGLER_DRILL_MARGIN,
                    image_size: int = 64, kubeconfig: Path | None = None, after_s: float = 15,
                    samples: int = 50_000_000) -> StragglerResult:
    """``agents`` nodes train; after ``healthy_s`` one node's workers (not rank 0's) get ``share`` of
    the CPU time they would have (stopped and continued in turn, as a CPU quota does) for ``slowed_s``.
    Each node's pod name is its agent's name, its node's ``node-<name>``. Returns the straggler events
    before and after.

    ``kubeconfig`` (an API server that has those nodes): metrics.straggler_policy=replace. The slowed
    node's workers then taint their node and leave once it is named; the drill measures the job without
    it over its first three step reports and ``after_s`` more, then starts a fresh node in its place, as
    the job's controller would."""
    from training.contract import EXIT_REPLACE_NODE, NODE_NAME_ENV, PLATFORM_TUNING, POD_NAME_ENV

    work.mkdir(parents=True, exist_ok=True)
    result = StragglerResult()
    replace_policy = kubeconfig is not None
    # A forward pass of some milliseconds (the drills' MLP on 64 px inputs): the quota's periods then
    # stretch each one, as a throttled device stretches every kernel.
    args = [*trainer_args(work, samples), f"--train.log_every_steps={log_every_steps}",
            f"--metrics.straggler_margin={margin}", f"--model.image_size={image_size}"]
    if replace_policy:
        args.append("--metrics.straggler_policy=replace")
    # Replacing needs room to shrink; the fresh node is admitted after a few seconds, not the shipped 30.
    tuning = replace(PLATFORM_TUNING, scale_up_after_s=5.0) if replace_policy else PLATFORM_TUNING
    min_nodes = agents - 1 if replace_policy else agents

    def start(name: str) -> Agent:
        env = {POD_NAME_ENV: name, NODE_NAME_ENV: f"node-{name}"}
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        return Agent(name, endpoint, "stragglers", work, args, min_nodes=min_nodes, max_nodes=agents, env=env,
                     tuning=tuning)

    running: list[Agent] = []
    with LocalEtcd() as endpoint:
        try:
            for index in range(agents):
                running.append(start(f"n{index:02d}"))
            wait_until(lambda: [e for e in events(work, "step") if e["world_size"] == agents], "training", 300,
                       running)
            time.sleep(healthy_s)
            victim = running[-1]
            result.slowed_pod = victim.name
            result.named_healthy = events(work, "straggler")
            result.slowed_at_step = events(work, "step")[-1]["step"]
            healthy = [e for e in events(work, "step") if e["world_size"] == agents][1:]
            result.healthy_rate = _per_node_rate(healthy, agents)
            slowed_since = time.time()
            stop = threading.Event()
            slowing = threading.Thread(target=throttle, args=(_descendants(victim.proc.pid), stop, share), daemon=True)
            slowing.start()
            try:
                if replace_policy:
                    # Until rank 0 names the node and replaces it. The quota ends there: it stands for a
                    # slow device, and a node whose device is slow leaves at its host's speed. Held on, the
                    # node's own leaving (its part of the stop checkpoint, the taint, its exit) crawled at
                    # 15 % for 5 to 19 s while the survivors waited for it to end the round.
                    wait_until(lambda: [e for e in events(work, "straggler_replaced") if e["time"] > slowed_since],
                               "the straggler named and replaced", slowed_s, running)
                else:
                    time.sleep(slowed_s)
            finally:
                stop.set()
                slowing.join()
            result.named_slowed = [e for e in events(work, "straggler") if e["time"] > slowed_since]
            if result.named_slowed:
                named_at = result.named_slowed[0]["step"]
                # Rank 0 writes the naming before that report's step event: wait for it before counting.
                wait_until(lambda: [e for e in events(work, "step") if e["step"] >= named_at],
                           "the report that named the straggler", 60, running)
                result.windows_to_name = len([e for e in events(work, "step")
                                              if e["time"] > slowed_since and e["step"] <= named_at])
            if replace_policy:
                result.replaced = events(work, "straggler_replaced")[-1]
                assert result.replaced["pod"] == victim.name, result.replaced
                wait_until(lambda: victim.proc.poll() is not None, "the replaced node's exit", 120, running)
                result.exit_codes[victim.name] = victim.wait(timeout=10)
                left_at = time.time()
                assert result.exit_codes[victim.name] == EXIT_REPLACE_NODE, victim.output()[-3000:]
                survivors = [a for a in running if a is not victim]
                wait_until(lambda: len([e for e in events(work, "step") if e["time"] > left_at
                                        and e["world_size"] == agents - 1]) >= 3,
                           "the job without the replaced node", 120, survivors)
                result.resume = next(e for e in events(work, "resume") if e["time"] > result.replaced["time"])
                result.steps_again = max(0, result.replaced["step"] - result.resume["step"])
                time.sleep(after_s)
                without = [e for e in events(work, "step") if e["time"] > left_at and e["world_size"] == agents - 1]
                result.without_rate = _per_node_rate(without[1:], agents - 1)
                fresh = start(f"n{agents:02d}")
                running.append(fresh)
                back = wait_until(lambda: [e for e in events(work, "step") if e["time"] > left_at
                                           and e["world_size"] == agents], "a fresh node in its place", 300,
                                  [*survivors, fresh])[0]
                result.back_to_full_s = round(back["time"] - left_at, 1)
        finally:
            for agent in running:
                agent.stop()
                result.exit_codes.setdefault(agent.name, agent.proc.returncode)
            result.warnings = agent_warnings(running)
    return result


def _per_node_rate(steps: list[dict], nodes: int) -> float | None:
    """Samples a second per node over ``steps`` (step events, each every log_every_steps)."""
    rates = [e["samples_per_s"] for e in steps if e.get("samples_per_s")]
    return round(statistics.median(rates) / nodes, 1) if rates else None
