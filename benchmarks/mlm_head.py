"""BERT's masked-LM step with the vocabulary projection at every position vs at the masked ones.

    .venv/bin/python benchmarks/mlm_head.py --model bert_base --batch 8 --seq-len 128

Forward + backward, one process, side by side in one run, median of --repeats after a warm-up;
wall clock on CPU (synchronous). On a GPU, run it with --device cuda: every timed point follows
torch.cuda.synchronize().
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.diagnostics.throughput import compare_mlm_heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert_base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    median = compare_mlm_heads(args.model, args.batch, args.seq_len, args.repeats, torch.device(args.device))
    full, masked = median["every position"], median["masked only"]
    print(f"{args.model}, batch {args.batch} x {args.seq_len}, {args.device}: every position {full * 1000:.0f} ms, "
          f"masked only {masked * 1000:.0f} ms per step: x{full / masked:.2f}")


if __name__ == "__main__":
    main()
