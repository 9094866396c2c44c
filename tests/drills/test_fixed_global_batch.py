"""A fixed global batch: the same update at any world size, with gradients synced once per step."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from training.config import load_train_config
from trainctl.backends.local_cluster import free_port
from training.loop.trainer import Trainer

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = [pytest.mark.untimed, pytest.mark.timeout(180)]
STEPS = 3


def config(checkpoints, world_hint: str = ""):
    return load_train_config(None, [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=5", "--data.synthetic_samples=200",
        "--data.num_workers=0", "--train.global_batch_size=30", "--train.micro_batch_size=8",
        f"--train.max_steps={STEPS}", "--train.precision=fp32", "--train.device=cpu",
        f"--checkpoint.dir={checkpoints}", "--checkpoint.async_save=false", "--optim.lr=0.5",
    ])


def _worker(rank: int, world: int, port: int, checkpoints: str, counts) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    trainer = Trainer(config(checkpoints))
    calls = counts[rank] if counts is not None else None

    def counting_hook(state, bucket):
        calls.append(1)
        return allreduce_hook(state, bucket)

    trainer.model.register_comm_hook(None, counting_hook)
    trainer.run()
    counts[rank] = len(calls)


def run_world(world: int, checkpoints) -> list[int]:
    with mp.Manager() as manager:
        counts = manager.list([manager.list() for _ in range(world)])
        mp.spawn(_worker, args=(world, free_port(), str(checkpoints), counts), nprocs=world, join=True)
        return list(counts)


def final_model(checkpoints) -> dict:
    return torch.load(sorted(checkpoints.glob("step-*.pt"))[-1], weights_only=True)["model"]


def test_one_and_three_workers_make_the_same_updates(tmp_path):
    alone = Trainer(config(tmp_path / "one"))
    assert (alone.layout.accumulation, alone.layout.micro_batch) == (5, 6)  # 30 slots: no padding
    initial = {n: t.clone() for n, t in alone.module.state_dict().items()}
    alone.run()
    counts = run_world(3, tmp_path / "three")  # 2 micro-steps of 5 per rank, nothing padded
    for name, tensor in final_model(tmp_path / "one").items():
        assert not torch.allclose(initial[name], tensor, atol=1e-3), f"{name} did not train"
        assert torch.allclose(final_model(tmp_path / "three")[name], tensor, atol=1e-6), name
    # One gradient all-reduce per step (the model fits one DDP bucket): micro-steps but the
    # last run under no_sync.
    assert counts == [STEPS] * 3
