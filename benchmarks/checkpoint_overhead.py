"""What checkpoints cost: training time at the default interval, and loading at a restart.

    python benchmarks/checkpoint_overhead.py [--interval 20 --steps 120] [--ranks 2 4] [--snapshot-model bert_large]

1. Overhead. The same training run without checkpoints, with asynchronous saves (the default)
   and with synchronous ones, side by side, several times each. Checkpointing at a short
   interval makes its cost measurable; the cost per checkpoint is then scaled to the default
   interval (checkpoint.interval_steps).
2. Restart. A checkpoint of the same model is resumed under the platform launcher with 2 and
   4 workers: rank 0 reads the file once and broadcasts it (the ``resume`` event's ``read_s`` and
   ``load_s``). Beside it, the same number of processes each reading the file themselves, as
   every rank did before, with the bytes each approach reads from the shared file system. Here
   the file is in the page cache and the broadcast is gloo on loopback, so the times show the
   cost of the broadcast, not what FSx would charge for N reads: that is the bytes column.
3. Snapshot (CUDA only; elsewhere it says it waits for a GPU). What an asynchronous save holds the
   loop up for (``blocking_s`` of ``checkpoint_saved``) on a model and AdamW state on the GPU:
   copying each tensor to pageable host memory, as saves did before, against queueing
   non-blocking copies into page-locked buffers (training/loop/checkpoint.py, Snapshot), and
   how long after that those copies are done (which the writer thread waits for, not the loop).
   Interleaved, after a device sync, as the trainer's save follows its finiteness check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from training.config import CheckpointSection, load_train_config
from training.loop.checkpoint import HostCopies, Snapshot
from training.loop.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent


def model_args(args) -> list[str]:
    return [f"--model.name={args.model}", f"--model.image_size={args.image_size}", "--data.num_workers=0",
            f"--train.global_batch_size={args.batch}", f"--train.micro_batch_size={args.batch}",
            "--train.precision=fp32", "--train.device=cpu", f"--optim.name={args.optimizer}",
            "--eval.enabled=false"]  # its time is no checkpoint's


def run(args, interval: int, async_save: bool) -> tuple[float, float, int]:
    """(training seconds, seconds the loop blocked on saves, checkpoints written before the last step)."""
    with tempfile.TemporaryDirectory() as scratch:
        config = load_train_config(None, [
            *model_args(args), f"--train.max_steps={args.steps}", f"--train.log_every_steps={args.steps}",
            f"--checkpoint.dir={scratch}", f"--checkpoint.interval_steps={interval}",
            f"--checkpoint.async_save={str(async_save).lower()}", f"--metrics.jsonl_path={scratch}/metrics.jsonl",
        ])
        trainer = Trainer(config)
        started = time.perf_counter()
        trainer.run()
        elapsed = time.perf_counter() - started
        events = [json.loads(line) for line in Path(scratch, "metrics.jsonl").read_text().splitlines()]
    # The final checkpoint is written by every run; count only the periodic ones.
    periodic = [e for e in events if e["event"] == "checkpoint_saved" and e["step"] < args.steps]
    return elapsed, sum(e["blocking_s"] for e in periodic), len(periodic)


def overhead(args) -> None:
    default_interval = CheckpointSection().interval_steps
    results: dict[str, list] = {"none": [], "async": [], "sync": []}
    for _ in range(args.repeats):  # interleaved, so drift hits every mode alike
        results["none"].append(run(args, 10**9, True))
        results["async"].append(run(args, args.interval, True))
        results["sync"].append(run(args, args.interval, False))
    base = statistics.median(r[0] for r in results["none"])
    step_time = base / args.steps
    print(f"model {args.model} {args.image_size}px batch {args.batch}, {args.steps} steps, "
          f"{step_time * 1000:.1f} ms/step without checkpoints (median of {args.repeats})")
    for mode in ("async", "sync"):
        elapsed = statistics.median(r[0] for r in results[mode])
        count = statistics.median(r[2] for r in results[mode])
        per_save = max(0.0, (elapsed - base) / count)
        blocking = statistics.median(r[1] for r in results[mode]) / count
        at_default = per_save / (default_interval * step_time)
        print(f"  {mode:<5} {count:.0f} saves in {args.steps} steps: {100 * (elapsed - base) / base:5.2f} % of "
              f"training time; {per_save * 1000:.0f} ms per checkpoint ({blocking * 1000:.0f} ms blocking the "
              f"loop) -> {100 * at_default:.3f} % at the default interval of {default_interval} steps")


def restart(args) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        common = [*model_args(args), f"--checkpoint.dir={work}/checkpoints", "--checkpoint.async_save=false",
                  f"--metrics.jsonl_path={work}/metrics.jsonl", "--train.log_every_steps=1"]
        subprocess.run([sys.executable, "-m", "training", "train", *common, "--train.max_steps=1"], cwd=REPO,
                       check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        checkpoint = next((work / "checkpoints").glob("step-*.pt"))
        size = checkpoint.stat().st_size
        print(f"\nrestart: a checkpoint of {size / 2**20:.0f} MiB ({args.model} {args.image_size}px, "
              f"{args.optimizer}), median of {args.repeats}")
        for ranks in args.ranks:
            broadcast, each_reads = [], []
            for repeat in range(args.repeats):
                events = work / f"metrics-{ranks}-{repeat}.jsonl"
                target = work / f"checkpoints-{ranks}-{repeat}"
                target.mkdir()
                os.link(checkpoint, target / checkpoint.name)
                subprocess.run(
                    [sys.executable, "-m", "training.launcher", "--standalone", f"--nproc-per-node={ranks}",
                     "--start-method=forkserver", "-m", "training", "train", *common, f"--metrics.jsonl_path={events}",
                     "--train.max_steps=2", f"--checkpoint.dir={target}"],
                    cwd=REPO, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                resume = next(e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "resume")
                broadcast.append((resume["read_s"], resume["load_s"]))
                each_reads.append(_every_rank_reads(checkpoint, ranks))
            read = statistics.median(r for r, _ in broadcast)
            total = statistics.median(t for _, t in broadcast)
            print(f"  {ranks} ranks: rank 0 reads ({read:.2f} s) and broadcasts, all loaded in {total:.2f} s, "
                  f"{size / 2**20:.0f} MiB read from the file system  |  every rank reads itself: "
                  f"{statistics.median(each_reads):.2f} s, {ranks * size / 2**20:.0f} MiB read")


READER = """
import sys, time, torch
started = time.perf_counter()
torch.load(sys.argv[1], map_location="cpu", weights_only=True)
print(time.perf_counter() - started)
"""


def _every_rank_reads(checkpoint: Path, ranks: int) -> float:
    """Seconds until the last of ``ranks`` processes, started together, has loaded the file itself."""
    readers = [subprocess.Popen([sys.executable, "-c", READER, str(checkpoint)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(ranks)]
    return max(float(r.communicate()[0]) for r in readers)


def _pageable(state):
    """How saves copied to the host before Snapshot: each tensor to pageable memory, one at a time."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _pageable(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_pageable(v) for v in state)
    return state


def snapshot(args) -> None:
    if not torch.cuda.is_available():
        print("\nsnapshot: needs a CUDA device; the blocking part of an asynchronous save waits for a GPU")
        return
    from training.models import build_model

    model = build_model(args.snapshot_model).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()  # the moments exist
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    size = sum(t.numel() * t.element_size() for t in _tensors(state))
    copies = HostCopies()
    Snapshot(state, copies).ready()  # warm: the first page-locked allocation is the host allocator's
    times: dict[str, list[float]] = {"pageable": [], "queued": [], "copies done": []}
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        _pageable(state)
        times["pageable"].append(time.perf_counter() - started)
        torch.cuda.synchronize()
        started = time.perf_counter()
        taken = Snapshot(state, copies)
        times["queued"].append(time.perf_counter() - started)
        taken.ready()
        times["copies done"].append(time.perf_counter() - started)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nsnapshot of {args.snapshot_model} + AdamW, {size / 2**20:.0f} MiB on {torch.cuda.get_device_name()}, "
          f"median of {args.repeats}: the loop blocked {median['pageable'] * 1000:.0f} ms copying to pageable memory "
          f"against {median['queued'] * 1000:.1f} ms queueing copies to page-locked buffers, done "
          f"{median['copies done'] * 1000:.0f} ms after the save began")


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-restart", action="store_true")
    parser.add_argument("--snapshot-model", default="bert_large")
    args = parser.parse_args()
    if not args.skip_overhead:
        overhead(args)
    if not args.skip_restart:
        restart(args)
    snapshot(args)


if __name__ == "__main__":
    main()
