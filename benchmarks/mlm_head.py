"""BERT's masked-LM step with the vocabulary projection at every position vs at the masked ones.

    .venv/bin/python benchmarks/mlm_head.py --model bert_base --batch 8 --seq-len 128

Forward + backward, one process, side by side in one run, median of --repeats after a warm-up;
wall clock on CPU (synchronous). On a GPU, run it with --device cuda: every timed point follows
torch.cuda.synchronize().
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.models import build_model  # noqa: E402


def every_position(model, tokens, labels):
    logits = model(tokens)
    token_loss = nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100,
                                             reduction="none")
    chosen = (labels != -100).float()
    return (token_loss * chosen).sum(1) / chosen.sum(1).clamp(min=1)


def masked_only(model, tokens, labels):
    return model(tokens, labels=labels, per_sample=True)


def timed(step, model, tokens, labels, device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    step(model, tokens, labels).sum().backward()
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert_base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(args.model).to(device)
    tokens = torch.randint(0, model.size.vocab, (args.batch, args.seq_len), device=device)
    labels = torch.full_like(tokens, -100)
    chosen = torch.rand(tokens.shape, device=device) < 0.15
    labels[chosen] = tokens[chosen]
    times = {"every position": [], "masked only": []}
    for step in (every_position, masked_only):  # warm-up
        timed(step, model, tokens, labels, device)
    for _ in range(args.repeats):  # interleaved, so drift affects both alike
        for name, step in (("every position", every_position), ("masked only", masked_only)):
            model.zero_grad(set_to_none=True)
            times[name].append(timed(step, model, tokens, labels, device))
    full, masked = (statistics.median(times[k]) for k in ("every position", "masked only"))
    print(f"{args.model}, batch {args.batch} x {args.seq_len}, {int(chosen.sum())} masked positions, {device}: "
          f"every position {full * 1000:.0f} ms, masked only {masked * 1000:.0f} ms per step: x{full / masked:.2f}")


if __name__ == "__main__":
    main()
