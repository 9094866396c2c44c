"""Multi-rank stop/save agreement without a per-step host sync: each step's all-reduce is read at
the next step. Two real gloo ranks: the flags arrive a step late on every rank alike,
checkpoints still land on the interval's steps, and a stop raised on one rank checkpoints on
both one step later, so no step is lost."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.config import load_train_config
from training.loop.agreement import LaggedAgreement
from trainctl.backends.local_cluster import free_port

pytestmark = pytest.mark.timeout(180)


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")


def _exchange(rank: int, port: int, results) -> None:
    _join(rank, 2, port)
    dist.init_process_group("gloo")
    agreement = LaggedAgreement(torch.device("cpu"))
    seen = []
    for step in range(4):
        # rank 1 raises the first flag at step 1; rank 0 raises the second (a tensor) at step 2
        seen.append(agreement.exchange(rank == 1 and step == 1, torch.tensor(rank == 0 and step == 2)))
    agreement.settle()
    results[rank] = seen
    dist.destroy_process_group()


def test_each_steps_flags_reach_every_rank_at_the_next_step():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_exchange, args=(free_port(), results), nprocs=2, join=True)
        seen = dict(results)
    expected = [None, (False, False), (True, False), (False, True)]
    assert seen[0] == expected and seen[1] == expected


def _train(rank: int, port: int, work: str, stop_at: int | None) -> None:
    from training.loop.trainer import Trainer

    _join(rank, 2, port)
    config = load_train_config(None, [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=5", "--data.synthetic_samples=4000",
        "--data.num_workers=0", "--train.global_batch_size=16", "--train.micro_batch_size=8",
        "--train.max_steps=13", "--train.precision=fp32", "--train.device=cpu", "--train.log_every_steps=1",
        # Synchronous saves: an asynchronous one starts early by as many steps as the last write
        # lasted (the adaptive lead), which would make the steps depend on this machine's speed.
        f"--checkpoint.dir={work}/ckpt", "--checkpoint.interval_steps=4", "--checkpoint.keep_last=10",
        "--checkpoint.async_save=false",
        f"--metrics.jsonl_path={work}/metrics.jsonl",
    ])
    trainer = Trainer(config)
    if stop_at is not None and rank == 1:  # a SIGTERM on rank 1 while it trains step `stop_at`
        original = trainer._step

        def step_then_signal(feed):
            result = original(feed)
            if trainer.progress.step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.monotonic() + 5
                while not trainer.stop.requested and time.monotonic() < deadline:
                    time.sleep(0.01)  # the handler's watcher thread sets it
            return result

        trainer._step = step_then_signal
    try:
        trainer.run()
    finally:
        dist.destroy_process_group()  # as training.loop.trainer.train does, not in the interpreter's teardown


def run(tmp_path: Path, stop_at: int | None) -> tuple[list[int], list[dict]]:
    mp.spawn(_train, args=(free_port(), str(tmp_path), stop_at), nprocs=2, join=True)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = sorted(int(p.stem.split("-")[1]) for p in (tmp_path / "ckpt").glob("step-*.pt"))
    return steps, records


def test_checkpoints_land_on_the_intervals_steps(tmp_path):
    steps, records = run(tmp_path, stop_at=None)
    assert steps == [4, 8, 12, 13]  # every 4 steps, and the finish
    assert [r["step"] for r in records if r["event"] == "checkpoint_started"] == [4, 8, 12, 13]


def test_a_stop_on_one_rank_checkpoints_both_a_step_later_and_loses_nothing(tmp_path):
    steps, records = run(tmp_path, stop_at=6)
    stop = next(r for r in records if r["event"] == "stop")
    assert stop["step"] == 7 and steps[-1] == 7  # asked during step 6, saved after step 7 by both ranks
    trained = max(r["step"] for r in records if r["event"] == "step")
    assert trained == 7  # nothing trained past the checkpoint: 0 steps lost
