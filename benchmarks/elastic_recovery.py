"""Elastic recovery on loopback: time from killing a node to the survivor's first step, and steps lost.

Two real torchrun agents (CPU, gloo) and a real etcd. One agent's process group is SIGKILLed,
as a node dies; the clock stops at the first step the survivor finishes afterwards. Three
launch settings run side by side, alternating, in one run:

- platform: the platform's own settings (training/launch.py: PLATFORM_TUNING, etcd-v2,
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1);
- tuned torchrun: DESIGN.md's tuned --rdzv-conf (last_call_timeout=2, keep_alive 1 s x 3);
- torchrun defaults: no --rdzv-conf.

Then one SIGTERM trial with the platform settings: steps lost must be 0.

    python benchmarks/elastic_recovery.py [--trials 3]
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

from training.launch import PLATFORM_TUNING, RendezvousTuning  # noqa: E402
from training.local_cluster import Agent, LocalEtcd, read_events, wait_until  # noqa: E402

SETTINGS = {
    "platform": PLATFORM_TUNING,
    "tuned torchrun": RendezvousTuning(last_call_timeout=2, keep_alive_interval=1, keep_alive_max_attempt=3),
    "torchrun defaults": None,
}
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


def trial(etcd: str, name: str, tuning, signal_kind: str = "kill") -> dict:
    work = Path(tempfile.mkdtemp(prefix="recovery-"))
    run_id = f"bench-{time.monotonic_ns()}"
    a = Agent("a", etcd, run_id, work, trainer_args(work), tuning=tuning)
    b = Agent("b", etcd, run_id, work, trainer_args(work), tuning=tuning)
    try:
        wait_until(lambda: len(_steps(work, world=2)) > 80, "two nodes training", 120, [a, b], poll=0.02)
        before = max(e["step"] for e in _steps(work))
        if signal_kind == "kill":
            at = b.kill_node()
        else:
            at = b.terminate()
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
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    results: list[dict] = []
    with LocalEtcd() as etcd:
        for _ in range(args.trials):
            for name, tuning in SETTINGS.items():
                results.append(trial(etcd, name, tuning))
                print(json.dumps(results[-1]), flush=True)
        results.append(trial(etcd, "platform", PLATFORM_TUNING, "term"))
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


if __name__ == "__main__":
    main()
