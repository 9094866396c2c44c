"""Trainer throughput against a bare forward/backward/step loop, same model and batch, one CPU process.

    python benchmarks/trainer_overhead.py [--model resnet18 --image-size 64 --batch 32]

The trainer reads synthetic data inline (num_workers=0), so both sides compute on the same
cores; the ratio is the cost of the sampler, loss weighting, stop checks and metrics.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.diagnostics.throughput import compare_with_bare_loop
from training.config import load_train_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = load_train_config(None, [
        f"--model.name={args.model}", f"--model.image_size={args.image_size}", "--model.num_classes=1000",
        "--data.num_workers=0", f"--train.micro_batch_size={args.batch}", "--train.precision=fp32",
        "--train.device=cpu", "--optim.name=sgd",
    ])
    print(compare_with_bare_loop(config, args.steps, 5, args.repeats).table())


if __name__ == "__main__":
    main()
