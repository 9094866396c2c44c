"""A torchrun program of a job's own, as a user would bring it: FSDP2 on gloo, checkpoints with DCP.

It imports nothing of this project (tests/drills/test_own_program.py runs it through the platform's
launcher, injected as a pod gets it, and checks that ``training`` is not importable here). It
follows the contract of docs/job-spec.md, "Your own torchrun program":

- torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) forms the group;
- checkpoints go to ``$PLATFORM_CHECKPOINT_DIR/step-<N>``, written under a hidden name and renamed
  once complete, so the launcher counts only whole ones as progress; a restart at another world
  size loads the newest and DCP reshards it;
- a wrong argument exits 78 (the platform's "do not retry").

Deterministic by construction: the data of step N is the same global batch whatever the world
size (each rank takes its rows of it), the loss is the global batch's mean, so a run that lost a
node and resumed at world size 1 has the losses of an uninterrupted run, within float rounding.

Arguments: ``--steps N --interval N --loss-file PATH [--step-seconds S] [--device cpu|cuda]``
(cuda: NCCL, one GPU per worker by LOCAL_RANK; benchmarks/gpu_check.py runs it so).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

EXIT_CONFIG = 78  # the platform's "do not retry" (docs/job-spec.md, "Your own torchrun program")
GLOBAL_BATCH = 8  # rows per step, divisible by every world size the drill uses (1, 2)
DIM = 32


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: the same rows whatever the world size."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=generator)
    return x, x[:, :4].sum(dim=1, keepdim=True).sin()


def newest_checkpoint(directory: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint (step-<N> with DCP's .metadata, which it writes last)."""
    found = [(int(p.name.split("-")[1]), p) for p in directory.glob("step-*") if (p / ".metadata").exists()]
    return max(found) if found else None


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--interval", type=int, required=True)
    parser.add_argument("--loss-file", required=True)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    directory = os.environ.get("PLATFORM_CHECKPOINT_DIR")
    if args.steps < 1 or args.interval < 1 or not directory:
        print("config error: --steps and --interval must be positive and PLATFORM_CHECKPOINT_DIR set", file=sys.stderr)
        return EXIT_CONFIG
    checkpoints = Path(directory)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    model = build_model().to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    start = 0
    resumed = newest_checkpoint(checkpoints)
    if resumed is not None:
        state = {"model": model.state_dict(), "optim": None}
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(resumed[1]))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = resumed[0]
    log = open(args.loss_file, "a") if rank == 0 else None  # noqa: SIM115 - open for the whole run
    if log:
        log.write(json.dumps({"event": "start", "world_size": world, "resumed_from": start, "time": time.time(),
                              "training_importable": importable("training"),
                              "training_loop_importable": importable("training.loop")}) + "\n")
        log.flush()
    rows = GLOBAL_BATCH // world
    for step in range(start, args.steps):
        x, y = batch(step)
        x, y = x[rank * rows:(rank + 1) * rows].to(device), y[rank * rows:(rank + 1) * rows].to(device)
        loss = torch.nn.functional.mse_loss(model(x), y)  # this rank's mean; FSDP averages gradients over ranks
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if log:
            log.write(json.dumps({"event": "step", "step": step + 1, "loss": total.item() / world,
                                  "world_size": world, "time": time.time()}) + "\n")
            log.flush()
        if (step + 1) % args.interval == 0 or step + 1 == args.steps:
            partial = checkpoints / f".step-{step + 1}.partial"
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(partial))
            dist.barrier()
            if rank == 0:
                partial.rename(checkpoints / f"step-{step + 1}")
            dist.barrier()
        time.sleep(args.step_seconds)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
