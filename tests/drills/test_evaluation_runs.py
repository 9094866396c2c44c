"""Validation in real runs: each sample once at any world size with the same figures (two
processes with gloo), an eval event every N steps and at the end, the same steps however a job
is stopped and resumed, and nothing changed in what training does."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.unit.test_evaluation import tiny_config
from training.config import load_train_config
from training.data.datasets import build_dataset
from training.device import detect
from trainctl.backends.local_cluster import free_port
from training.loop import evaluate
from training.loop.evaluate import Evaluator
from training.loop.metrics import MetricsWriter
from training.loop.trainer import Trainer
from training.models import build_model

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = [pytest.mark.untimed, pytest.mark.timeout(240)]


# --- one process or two: the same figures -------------------------------------------------------


def _evaluate_in_world(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    runtime = detect("cpu")
    figures = {}
    for name in ("resnet18", "bert_tiny"):
        config = tiny_config(Path(out), name)
        torch.manual_seed(0)
        module = build_model(name, config.model.num_classes, config.model.image_size)
        if name == "resnet18":
            # Each rank's BatchNorm statistics drift apart in training (its own batches); rank 0's
            # are those a one-process run holds, and the ones every rank must evaluate with.
            with torch.no_grad():
                module(torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(rank)) * (1 + rank))
        train_set = build_dataset(config, getattr(getattr(module, "size", None), "vocab", None))
        evaluator = Evaluator.build(config, runtime, module, train_set, channels_last=False)
        figures[name] = evaluator.evaluate(step=1, epoch=0, metrics=MetricsWriter(False, None, None))
        assert module.training
    if rank == 0:
        Path(out, f"world-{world}.json").write_text(json.dumps(figures))
    if world > 1:
        dist.destroy_process_group()


def test_one_and_two_processes_evaluate_each_sample_once_with_identical_figures(tmp_path):
    for world in (1, 2):
        mp.spawn(_evaluate_in_world, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    one, two = (json.loads((tmp_path / f"world-{world}.json").read_text()) for world in (1, 2))
    assert one["resnet18"]["samples"] == 21 and one["bert_tiny"]["samples"] == 21
    assert one["bert_tiny"]["masked_tokens"] == 21 * 5  # round(0.15 * 32) of each sequence
    assert one == two


def test_evaluation_runs_in_the_precision_training_chose(tmp_path, monkeypatch):
    # train.precision=auto resolves per device (bf16 on CPU); evaluation once passed "auto" to
    # autocast, which took it for fp16.
    config = tiny_config(tmp_path, "resnet18")
    config = config.model_copy(update={"train": config.train.model_copy(update={"precision": "auto"})})
    runtime = detect("cpu")
    asked = []
    autocast = runtime.autocast
    monkeypatch.setattr(runtime, "autocast", lambda precision: asked.append(precision) or autocast(precision))
    module = build_model("resnet18", config.model.num_classes, config.model.image_size)
    train_set = build_dataset(config, None)
    Evaluator.build(config, runtime, module, train_set, channels_last=False).evaluate(
        step=1, epoch=0, metrics=MetricsWriter(False, None, None))
    assert asked and set(asked) == {runtime.precision("auto")} == {"bf16"}


# --- in the trainer -----------------------------------------------------------------------------


def run_config(tmp_path, *extra: str, model: str = "mlp"):
    return load_train_config(None, [
        f"--model.name={model}", "--model.image_size=16", "--model.num_classes=4", "--data.synthetic_samples=256",
        "--data.num_workers=0", "--train.global_batch_size=32", "--train.micro_batch_size=16",
        "--train.max_steps=8", "--train.log_every_steps=4", "--train.precision=fp32", "--train.device=cpu",
        "--eval.synthetic_samples=40", "--eval.every_steps=3", "--checkpoint.async_save=false",
        "--checkpoint.interval_steps=100", f"--checkpoint.dir={tmp_path}/checkpoints",
        f"--metrics.jsonl_path={tmp_path}/metrics.jsonl", *extra,
    ])


def records(tmp_path, kind: str) -> list[dict]:
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == kind]


def figures(event: dict) -> dict:
    return {k: v for k, v in event.items() if k not in ("time", "eval_s", "event")}


def test_every_n_steps_and_at_the_end_an_eval_event_and_the_summary_has_the_last(tmp_path):
    Trainer(run_config(tmp_path, f"--metrics.tensorboard_dir={tmp_path}/tb")).run()
    evals = records(tmp_path, "eval")
    assert [e["step"] for e in evals] == [3, 6, 8]
    assert set(evals[0]) == {"event", "time", "step", "epoch", "samples", "top1", "top5", "correct_top1",
                             "correct_top5", "loss", "skipped", "eval_s"}
    assert evals[0]["samples"] == 40 and evals[0]["skipped"] == 0
    assert evals[0]["top1"] == evals[0]["correct_top1"] / 40 and evals[0]["loss"] > 0
    (finished,) = records(tmp_path, "finished")
    assert finished["eval"] == figures(evals[-1])
    # The run's mean rate is training's: the evaluations' time is reported apart and left out.
    # The run's evaluation time spans each evaluation's own (and the writing of its event): never
    # less than their sum, less the rounding to ms. Not equal within a bound: a loaded machine
    # can take any time to write an event.
    assert finished["eval_s"] >= sum(e["eval_s"] for e in evals) - 0.0005 * (len(evals) + 1) > 0
    trained = finished["samples_per_s"] * (finished["elapsed_s"] - finished["eval_s"])
    assert trained == pytest.approx(8 * 32, rel=5e-3)  # elapsed_s and eval_s are rounded to ms
    checkpoint = torch.load(tmp_path / "checkpoints" / "step-000000008.pt", weights_only=True)
    assert checkpoint["progress"]["evaluated_step"] == 8


def test_only_at_the_end_by_default(tmp_path):
    Trainer(run_config(tmp_path, "--eval.every_steps=0")).run()
    assert [e["step"] for e in records(tmp_path, "eval")] == [8]


def stopping_at(trainer: Trainer, step: int, how: str) -> Trainer:
    """``trainer`` with a SIGTERM (a stop: checkpoint, then exit) or a crash (nothing saved)
    right after the step that reaches ``step``."""
    take_step = trainer._step

    def step_then(feed):
        result = take_step(feed)
        if trainer.progress.step == step:
            if how == "crash":
                raise RuntimeError("the node is gone")
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    trainer._step = step_then
    return trainer


@pytest.mark.parametrize("how, at, interval", [
    ("sigterm", 6, 100),  # stopped at a step due for evaluation: saved first, evaluated on resuming
    ("sigterm", 4, 100),  # stopped between two
    ("crash", 5, 3),  # died after step 5; resumes from the checkpoint of step 3, evaluated already
    ("sigterm", 8, 100),  # stopped at the very end, before its evaluation
])
def test_a_job_stopped_and_resumed_evaluates_at_the_same_steps_with_the_same_figures(tmp_path, how, at, interval):
    Trainer(run_config(tmp_path / "straight", f"--checkpoint.interval_steps={interval}")).run()
    expected = [figures(e) for e in records(tmp_path / "straight", "eval")]
    assert [e["step"] for e in expected] == [3, 6, 8]

    config = run_config(tmp_path / "stopped", f"--checkpoint.interval_steps={interval}")
    interrupted = stopping_at(Trainer(config), at, how)
    if how == "crash":
        with pytest.raises(RuntimeError):
            interrupted.run()
        interrupted.finish_writing()
    else:
        assert interrupted.run().stopped_by_signal
    Trainer(config).run()
    assert [figures(e) for e in records(tmp_path / "stopped", "eval")] == expected


@pytest.mark.parametrize("model", ["resnet18", "bert_tiny"])
def test_evaluating_changes_nothing_in_training(tmp_path, model):
    """BatchNorm back in training mode with its statistics untouched; dropout's generator untouched."""
    extra = ["--data.seq_len=32"] if model == "bert_tiny" else []
    weights = {}
    for every in (0, 2):
        work = tmp_path / str(every)
        trainer = Trainer(run_config(work, f"--eval.every_steps={every}", "--train.max_steps=4", *extra, model=model))
        trainer.run()
        assert trainer.module.training
        assert len(records(work, "eval")) == (1 if every == 0 else 2)
        weights[every] = torch.load(work / "checkpoints" / "step-000000004.pt", weights_only=True)["model"]
    assert all(torch.equal(weights[0][name], weights[2][name]) for name in weights[0])


def test_a_sigterm_during_an_evaluation_stops_it_checkpoints_first_and_it_runs_again_on_resuming(tmp_path):
    """Before, a stop waited for the evaluation: a long one outlasted the stop budget (SIGKILL, no
    checkpoint). Now the evaluation yields within a few batches, the stop checkpoint is written at
    its step, and the resumed job evaluates there with the figures of an uninterrupted run."""
    extra = ["--eval.synthetic_samples=200", "--eval.batch_size=8"]  # 25 batches
    Trainer(run_config(tmp_path / "straight", *extra)).run()
    expected = [figures(e) for e in records(tmp_path / "straight", "eval")]
    assert [e["step"] for e in expected] == [3, 6, 8]

    config = run_config(tmp_path / "stopped", *extra)
    trainer = Trainer(config)
    evaluated = []
    sums = trainer.evaluator._sums

    def sums_then_sigterm(batch):
        if trainer.progress.step == 6:
            evaluated.append(batch)
            if len(evaluated) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        return sums(batch)

    trainer.evaluator._sums = sums_then_sigterm
    assert trainer.run().stopped_by_signal
    assert len(evaluated) <= evaluate.YIELD_EVERY_BATCHES < 25  # it yielded, not finished
    assert [e["step"] for e in records(tmp_path / "stopped", "eval")] == [3]
    stop = torch.load(tmp_path / "stopped" / "checkpoints" / "step-000000006.pt", weights_only=True)
    assert stop["progress"]["evaluated_step"] == 3  # the one at 6 is still owed

    Trainer(config).run()
    assert [figures(e) for e in records(tmp_path / "stopped", "eval")] == expected
