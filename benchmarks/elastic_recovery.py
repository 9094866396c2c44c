"""Elastic recovery on loopback: time from killing a node to the survivor's first step, and steps lost.

Two real agents (CPU, gloo) and a real etcd. One agent's process group is SIGKILLed, as a
node dies; the clock stops at the first step the survivor finishes afterwards. The launcher is
what a pod runs (training/launcher/main.py launch_command: the platform-etcd rendezvous on etcd's v3
API, forked workers). torchrun's own etcd-v2 backend is no longer compared: it needs python-etcd
and etcd's v2 API, which the platform dropped (its figures, measured before: ~40 s with torch's
defaults, ~7 s tuned; docs/elasticity-and-checkpoints.md). benchmarks/elastic_scale.py measures 2 to 16 agents.

Then one SIGTERM trial with the platform launcher (steps lost must be 0), and with --failures
the failure drills (tests/drill_harness.py) whose costs docs/elasticity-and-checkpoints.md shows.

    python benchmarks/elastic_recovery.py [--trials 5] [--failures]   (--trials 0: the failure table alone)

With --lost-node 2,8,16 [--moments 0,1,2] [--survivors memory,restart]: one node SIGKILLed between
two checkpoints, during a checkpoint write and during an evaluation, at each size, with the
survivors recovering from memory (the shipped launcher) and restarting from the checkpoint
(PLATFORM_REGROUP_IN_PLACE=0, as before issue 49): steps trained again, SIGKILL -> next step, and
the bytes read from the checkpoint folder
(tests.drill_harness.lost_node_drill). docs/elasticity-and-checkpoints.md shows the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.contract import PLATFORM_TUNING
from trainctl.backends.local_cluster import Agent, LocalEtcd, read_events, wait_until

SETTINGS = {"platform": PLATFORM_TUNING}
INTERVAL = 50


def trainer_args(work: Path) -> list[str]:
    return [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=10", "--data.synthetic_samples=400000",
        "--data.num_workers=0", "--train.global_batch_size=32", "--train.micro_batch_size=16", "--train.epochs=1",
        "--train.precision=fp32", "--train.log_every_steps=1", f"--checkpoint.dir={work}/ck",
        f"--checkpoint.interval_steps={INTERVAL}", f"--metrics.jsonl_path={work}/metrics.jsonl",
    ]


def _steps(work: Path, after: float = 0.0, world: int | None = None) -> list[dict]:
    return [e for e in read_events(work / "metrics.jsonl") if e["event"] == "step" and e["time"] > after
            and (world is None or e["world_size"] == world)]


def trial(etcd: str, name: str, signal_kind: str = "kill") -> dict:
    tuning = SETTINGS[name]
    work = Path(tempfile.mkdtemp(prefix="recovery-"))
    run_id = f"bench-{time.monotonic_ns()}"
    a = Agent("a", etcd, run_id, work, trainer_args(work), tuning=tuning)
    b = Agent("b", etcd, run_id, work, trainer_args(work), tuning=tuning)
    try:
        wait_until(lambda: len(_steps(work, world=2)) > 80, "two nodes training", 120, [a, b], poll=0.02)
        before = max(e["step"] for e in _steps(work))
        at = b.kill_node() if signal_kind == "kill" else b.terminate()
        first = wait_until(lambda: _steps(work, after=at, world=1), "the survivor's first step", 180, [a], poll=0.02)[0]
        resume = [e for e in read_events(work / "metrics.jsonl") if e["event"] == "resume" and e["time"] > at][0]
        # Steps trained before the signal that the survivor has to train again.
        trained = max(e["step"] for e in _steps(work) if e["time"] <= at + 0.0)
        return {"setting": name, "signal": signal_kind, "recovery_s": round(first["time"] - at, 2),
                "steps_lost": max(0, max(trained, before) - resume["step"])}
    finally:
        a.stop()
        b.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--failures", action="store_true", help="also run the failure drills and print their costs")
    parser.add_argument("--lost-node", metavar="SIZES", help="only the lost-node table, at these agent counts (2,8,16)")
    parser.add_argument("--moments", default="0,1,2", help="with --lost-node: which moments (0 between checkpoints, "
                                                           "1 during a write, 2 during an evaluation)")
    parser.add_argument("--survivors", default="memory,restart",
                        help="with --lost-node: memory (recover from memory), restart (from the checkpoint, as before)")
    args = parser.parse_args()
    if args.lost_node:
        lost_node_table([int(n) for n in args.lost_node.split(",")], [int(m) for m in args.moments.split(",")],
                        [way == "memory" for way in args.survivors.split(",")])
        return
    results: list[dict] = []
    if args.trials == 0:  # the failure table alone
        failure_table()
        return
    with LocalEtcd() as etcd:
        for _ in range(args.trials):
            for name in SETTINGS:
                results.append(trial(etcd, name))
                print(json.dumps(results[-1]), flush=True)
        results.append(trial(etcd, "platform", "term"))
        print(json.dumps(results[-1]), flush=True)
    print(f"\nrecovery from a killed node, median of {args.trials} (checkpoint interval {INTERVAL} steps):")
    platform = statistics.median(r["recovery_s"] for r in results if r["setting"] == "platform" and r["signal"] == "kill")
    for name in SETTINGS:
        runs = [r for r in results if r["setting"] == name and r["signal"] == "kill"]
        median = statistics.median(r["recovery_s"] for r in runs)
        lost = max(r["steps_lost"] for r in runs)
        print(f"  {name:<18} {median:6.2f} s  (x{median / platform:4.2f} of platform)  "
              f"runs {[r['recovery_s'] for r in runs]}  max steps lost {lost}")
    term = results[-1]
    print(f"  SIGTERM (platform) {term['recovery_s']:6.2f} s  steps lost {term['steps_lost']}")
    if args.failures:
        failure_table()


def lost_node_table(sizes: list[int], moments: list[int], in_place: list[bool]) -> None:
    """One node SIGKILLed at each size and moment, with each way of the survivors' (True: from memory)."""
    import dataclasses

    from tests.drill_harness import MOMENTS, lost_node_drill

    rows = []
    for size in sizes:
        for moment in (MOMENTS[m] for m in moments):
            for way in in_place:
                row = lost_node_drill(Path(tempfile.mkdtemp(prefix=f"lost-{size}-")), size, moment, way)
                rows.append(row)
                print(json.dumps(dataclasses.asdict(row)), flush=True)
    print(f"\n{'agents':>6} {'killed':<26} {'survivors':<22} {'steps again':>11} {'kill->step':>11} "
          f"{'resumed from':>18} {'bytes read':>11} {'eval again':>10}")
    for r in rows:
        how = "recover from memory" if r.in_place else "restart (before)"
        again = "-" if r.evaluation_again is None else ("once" if r.evaluation_again else "NO")
        print(f"{r.agents:>6} {r.moment:<26} {how:<22} {r.steps_again:>11} {r.kill_to_step_s:>10}s "
              f"{r.resumed_from:>18} {r.bytes_read:>11} {again:>10}")


def failure_table() -> None:
    """What each failure costs a running job: the drills of tests/drills/test_job_lifecycle.py, measured."""
    from tests.drill_harness import etcd_drill, every_sample_once, incarnation_drill

    plan = [("wait", 3), ("down", 20), ("wait", 3), ("down", 60), ("wait", 3), ("restart", 0), ("wait", 3),
            ("empty", 0)]
    runs = [etcd_drill(Path(tempfile.mkdtemp(prefix="etcd-drill-")), plan, samples=900_000),
            incarnation_drill(Path(tempfile.mkdtemp(prefix="incarnations-")))]
    print("\nwhat each failure costs (two nodes, checkpoint every 25 steps):")
    print(f"  {'disruption':<45} {'lasted':>7} {'trained meanwhile':>18} {'re-rendezvous':>14} "
          f"{'steps lost':>11} {'longest pause':>14}")
    for run in runs:
        for d in run.disruptions:
            print(f"  {d.what:<45} {d.lasted_s:6.1f}s {d.steps_during:>12} steps {d.restarts:>14} "
                  f"{d.steps_lost:>11} {d.stalled_s:>13.1f}s")
        print(f"  exit codes {run.exit_codes}; every sample once: "
              f"{every_sample_once(run.work, 900_000 if 'etcd' in str(run.work) else 120_000)}")


if __name__ == "__main__":
    main()
