"""Checkpoint overhead: the same training run with and without checkpoints, side by side.

    python benchmarks/checkpoint_overhead.py [--interval 20 --steps 120]

Checkpointing at a short interval makes its cost measurable; the cost per checkpoint is then
scaled to the default interval (checkpoint.interval_steps). Both async (the default) and
synchronous saves are measured.
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

from training.config import CheckpointSection, load_train_config  # noqa: E402
from training.trainer import Trainer  # noqa: E402


def run(args, interval: int, async_save: bool) -> tuple[float, float, int]:
    """(training seconds, seconds the loop blocked on saves, checkpoints written)."""
    with tempfile.TemporaryDirectory() as scratch:
        config = load_train_config(None, [
            f"--model.name={args.model}", f"--model.image_size={args.image_size}", "--data.num_workers=0",
            f"--train.global_batch_size={args.batch}", f"--train.micro_batch_size={args.batch}",
            f"--train.max_steps={args.steps}", "--train.precision=fp32", "--train.device=cpu",
            f"--train.log_every_steps={args.steps}", f"--checkpoint.dir={scratch}",
            f"--checkpoint.interval_steps={interval}", f"--checkpoint.async_save={str(async_save).lower()}",
            f"--metrics.jsonl_path={scratch}/metrics.jsonl",
        ])
        trainer = Trainer(config)
        started = time.perf_counter()
        trainer.run()
        elapsed = time.perf_counter() - started
        events = [json.loads(line) for line in open(f"{scratch}/metrics.jsonl")]
    saves = [e for e in events if e["event"] == "checkpoint"]
    # The final checkpoint is written by both runs; count only the periodic ones.
    periodic = [e for e in saves if e["step"] < args.steps]
    return elapsed, sum(e["blocking_s"] for e in periodic), len(periodic)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    default_interval = CheckpointSection().interval_steps
    results: dict[str, list] = {"none": [], "async": [], "sync": []}
    for _ in range(args.repeats):
        results["none"].append(run(args, 10**9, True))
        results["async"].append(run(args, args.interval, True))
        results["sync"].append(run(args, args.interval, False))
    base = statistics.median(r[0] for r in results["none"])
    step_time = base / args.steps
    print(f"model {args.model} {args.image_size}px batch {args.batch}, {args.steps} steps, "
          f"{step_time * 1000:.1f} ms/step without checkpoints")
    for mode in ("async", "sync"):
        elapsed = statistics.median(r[0] for r in results[mode])
        count = results[mode][0][2]
        per_save = max(0.0, (elapsed - base) / count)
        blocking = statistics.median(r[1] for r in results[mode]) / count
        at_default = per_save / (default_interval * step_time)
        print(f"  {mode:<5} every {args.interval} steps: {100 * (elapsed - base) / base:5.2f} % of training time; "
              f"{per_save * 1000:.0f} ms per checkpoint ({blocking * 1000:.0f} ms blocking the loop) -> "
              f"{100 * at_default:.3f} % at the default interval of {default_interval} steps")


if __name__ == "__main__":
    main()
