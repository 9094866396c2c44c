"""The per-step stop/save agreement as it was (a host sync each step) and as it is, side by side.

    python benchmarks/agreement_sync.py [--steps 200 --repeats 3 --kernels 100 --size 256]

Two ranks: gloo on CPU; NCCL on CUDA, one GPU a rank (with a single GPU one rank, as a one-GPU
torchrun job has: NCCL refuses two ranks on one device). Each step queues ``--kernels`` small
matrix products (a step whose launches take the host a while, as a real model's do) and then
the agreement with the trainer's five flags, the loss's finiteness a device tensor. Measured:
the wall clock between two synchronized points (device synchronized, then a barrier) around
``--steps`` steps, for each agreement in turn, ``--repeats`` times, alternating. The old one
builds its flags with ``torch.tensor(..., device=)`` and reads them with ``.tolist()``: on CUDA
each waits for the device, so the device idles while the host launches the next step; the new
one (training/loop/agreement.py) copies through pinned buffers and an event. On CPU the two do
the same work and the ratio is about 1.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.loop.agreement import LaggedAgreement


class BlockingAgreement:
    """The agreement before issue 35 (training/loop/elastic.py at afb10d1), verbatim but for names."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._in_flight = None

    def _flag_tensor(self, flags) -> torch.Tensor:
        value = torch.tensor([float(f) if isinstance(f, bool) else 0.0 for f in flags], device=self.device)
        for i, flag in enumerate(flags):
            if isinstance(flag, torch.Tensor):
                value[i] = flag.to(device=self.device, dtype=value.dtype).reshape(())
        return value

    def exchange(self, *flags):
        value = self._flag_tensor(flags)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True)
        previous, self._in_flight = self._in_flight, (work, value)
        if previous is None:
            return None
        previous[0].wait()
        return tuple(bool(v > 0) for v in previous[1].tolist())

    def settle(self) -> None:
        if self._in_flight is not None:
            self._in_flight[0].wait()
            self._in_flight = None


AGREEMENTS = {"old (host sync)": BlockingAgreement, "new (pinned + event)": LaggedAgreement}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _run(agreement, device: torch.device, weights: torch.Tensor, steps: int, kernels: int) -> float:
    _synchronize(device)
    started = time.perf_counter()
    for step in range(steps):
        x = weights
        for _ in range(kernels):
            x = torch.tanh(x @ weights)
        loss = x.mean()
        agreement.exchange(False, False, step % 50 == 49, ~torch.isfinite(loss), False)
    agreement.settle()
    _synchronize(device)
    return time.perf_counter() - started


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    weights = torch.randn(args.size, args.size, device=device) / args.size ** 0.5
    times: dict[str, list[float]] = {name: [] for name in AGREEMENTS}
    for make in AGREEMENTS.values():  # warm-up: allocations, NCCL's first collective
        _run(make(device), device, weights, 10, args.kernels)
    for _ in range(args.repeats):
        for name, make in AGREEMENTS.items():
            times[name].append(_run(make(device), device, weights, args.steps, args.kernels))
    if rank == 0:
        results["device"] = torch.cuda.get_device_name(device) if cuda else "cpu"
        results["world"] = world
        results["times"] = times
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", type=int, default=100, help="matrix products queued per step")
    parser.add_argument("--size", type=int, default=256, help="their side")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU even where CUDA exists")
    args = parser.parse_args()
    world = 2 if args.cpu or not torch.cuda.is_available() else min(2, torch.cuda.device_count())
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(world, _free_port(), args, results), nprocs=world, join=True)
        results = dict(results)
    times = results["times"]
    print(f"{results['device']}, {results['world']} rank(s), {args.steps} steps of {args.kernels} products "
          f"{args.size}x{args.size}, {args.repeats} repeats alternating (torch {torch.__version__})")
    print("| agreement | ms per step (median) | runs |")
    print("|---|---|---|")
    medians = {}
    for name, runs in times.items():
        medians[name] = statistics.median(runs) / args.steps * 1e3
        print(f"| {name} | {medians[name]:.3f} | {' / '.join(f'{r / args.steps * 1e3:.3f}' for r in runs)} |")
    old, new = medians.values()
    print(f"old / new: {old / new:.3f}")


if __name__ == "__main__":
    main()
