"""What rank 0 reports: JSON lines with throughput, data wait, memory, world size; MFU; TensorBoard."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from training.config import load_train_config
from training.loop.objective import learning_rate
from training.loop.trainer import Trainer

STEP_FIELDS = {
    "step", "epoch", "loss", "lr", "samples_per_s", "samples_per_s_per_device", "step_time_s", "data_wait_pct",
    "peak_memory_gib", "world_size", "restart_count", "mfu", "bad_samples",
}


def small_run(tmp_path, *extra: str):
    return load_train_config(None, [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=4", "--data.synthetic_samples=256",
        "--data.num_workers=1", "--train.global_batch_size=32", "--train.micro_batch_size=16",
        "--train.max_steps=8", "--train.log_every_steps=4", "--train.precision=bf16", "--train.device=cpu",
        f"--checkpoint.dir={tmp_path}/checkpoints", f"--metrics.jsonl_path={tmp_path}/metrics.jsonl", *extra,
    ])


def test_step_lines_carry_every_metric_and_events_say_what_happened(tmp_path):
    result = Trainer(small_run(tmp_path, f"--metrics.tensorboard_dir={tmp_path}/tb")).run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["event"] for r in records]
    assert kinds[:2] == ["rendezvous", "start"] and kinds[-1] == "finished"
    steps = [r for r in records if r["event"] == "step"]
    assert [s["step"] for s in steps] == [4, 8]
    assert set(steps[0]) == STEP_FIELDS | {"event", "time"}
    assert steps[0]["world_size"] == 1 and steps[0]["samples_per_s"] > 0 and 0 <= steps[0]["data_wait_pct"] <= 100
    assert steps[0]["mfu"] is None  # no published peak for a CPU
    assert result.step == 8 and list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_a_restart_resumes_and_says_from_which_checkpoint(tmp_path):
    Trainer(small_run(tmp_path)).run()
    Trainer(small_run(tmp_path, "--train.max_steps=12")).run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    resume = next(r for r in records if r["event"] == "resume")
    assert resume["step"] == 8 and resume["checkpoint"].endswith("step-000000008.pt")
    assert [r["step"] for r in records if r["event"] == "step"][-1] == 12


def test_mfu_uses_the_counted_flops_and_the_device_peak(tmp_path, monkeypatch):
    trainer = Trainer(small_run(tmp_path))
    flops = trainer._count_flops()
    # mlp, per sample: forward 2*in*out per layer; backward computes weight gradients for both
    # layers but an input gradient only for the second (the images need none).
    first, second = 2 * (3 * 16 * 16) * 256, 2 * 256 * 4
    assert flops == 2 * first + 3 * second
    trainer.runtime.peak_flops = 1e12
    trainer.run()
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if '"step"' in line and '"event": "step"' in line]
    assert steps[-1]["mfu"] == pytest.approx(steps[-1]["samples_per_s"] * flops / 1e12, rel=0.02)


def test_counting_flops_leaves_the_model_alone_and_works_at_32_px(tmp_path):
    # ResNet at 32 px has 1x1 feature maps at the end: a one-sample training-mode forward
    # there raises in BatchNorm, and any forward on the real model moves its running statistics.
    trainer = Trainer(load_train_config(None, [
        "--model.name=resnet18", "--model.image_size=32", "--model.num_classes=10", "--train.device=cpu",
        "--train.precision=fp32", f"--checkpoint.dir={tmp_path}/checkpoints"]))
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    flops = trainer._count_flops()
    assert flops and flops > 0
    after = trainer.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running_mean/var and num_batches_tracked too
    assert all(p.grad is None for p in trainer.module.parameters())


def test_flops_are_counted_once_per_run_not_at_every_restart(tmp_path, monkeypatch):
    Trainer(small_run(tmp_path)).run()
    import training.loop.trainer as trainer_module

    def no_second_count(_config):
        raise AssertionError("counted again on resume")

    monkeypatch.setattr(trainer_module, "count_training_flops", no_second_count)
    resumed = Trainer(small_run(tmp_path, "--train.max_steps=12"))
    assert resumed.resumed_from == 8 and resumed._count_flops() > 0
    resumed.run()


def test_the_schedule_warms_up_then_decays_by_sample_position():
    config = load_train_config(None, ["--optim.lr=1.0", "--optim.warmup_steps=10"])
    assert learning_rate(config, 0.05, 100, 1.0) == pytest.approx(0.5)
    assert learning_rate(config, 0.1, 100, 1.0) == pytest.approx(1.0)
    assert learning_rate(config, 1.0, 100, 1.0) == pytest.approx(0.0, abs=1e-9)
    assert learning_rate(config, 0.1, 100, 0.25) == pytest.approx(0.25)  # scale_lr applies on top


def test_scale_lr_runs_one_micro_batch_per_device_and_logs_the_scaled_rate(tmp_path):
    trainer = Trainer(small_run(tmp_path, "--train.batch_policy=scale_lr", "--train.global_batch_size=64",
                                "--optim.schedule=constant"))
    assert (trainer.layout.accumulation, trainer.global_batch, trainer.lr_scale) == (1, 16, 0.25)
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["lr_scale"] == 0.25
    assert {r["lr"] for r in records if r["event"] == "step"} == {0.1 * 0.25}


def test_reported_throughput_is_wall_clock_between_reports(tmp_path):
    # Windows of ~0.5 s or more, so that the events' millisecond timestamps and a loaded machine's
    # jitter stay well under 2 %.
    Trainer(small_run(tmp_path, "--train.max_steps=150", "--train.log_every_steps=50", "--model.image_size=48",
                      "--data.synthetic_samples=8192", "--train.precision=fp32")).run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    for before, after in itertools.pairwise(steps):
        external = (after["step"] - before["step"]) * 32 / (after["time"] - before["time"])
        assert after["samples_per_s"] == pytest.approx(external, rel=0.02)


def test_work_still_queued_on_the_device_is_counted(tmp_path, monkeypatch):
    """A fake asynchronous device: each step leaves 50 ms of work queued, done only when someone
    synchronizes. A CPU-side timer around each step would report ~0 ms steps."""
    from training.device import Runtime

    import dataclasses
    import time

    queued = {"s": 0.0}

    def mark_step():  # the end of a step's host-side work: its device work is still queued
        queued["s"] += 0.05

    def synchronize(self):
        time.sleep(queued["s"])
        queued["s"] = 0.0

    monkeypatch.setattr(Runtime, "synchronize", synchronize)
    trainer = Trainer(small_run(tmp_path, "--train.max_steps=8", "--train.log_every_steps=4",
                                "--train.precision=fp32"))
    trainer.runtime = dataclasses.replace(trainer.runtime, mark_step=mark_step)
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert all(r["step_time_s"] >= 0.05 for r in steps), [r["step_time_s"] for r in steps]
    assert all(r["samples_per_s"] <= 32 / 0.05 for r in steps)


def test_the_last_window_is_reported_before_the_loader_is_torn_down(tmp_path, monkeypatch):
    """Tearing down the loader's workers is not training time. Measured on an H100, it took 5-10 %
    of a 40-step window that ended after it, and made the trainer look that much slower."""
    from training.data.feed import DeviceFeed

    order = []
    close, report = DeviceFeed.close, Trainer._report
    monkeypatch.setattr(DeviceFeed, "close", lambda self: (order.append("loader torn down"), close(self))[1])
    monkeypatch.setattr(Trainer, "_report",
                        lambda self, *a: (order.append(f"report at {self.progress.step}"), report(self, *a))[1])
    # Without validation, whose loader is another one (tests/drills/test_evaluation_runs.py).
    Trainer(small_run(tmp_path, "--train.max_steps=6", "--train.log_every_steps=4", "--eval.enabled=false")).run()
    assert order == ["report at 4", "report at 6", "loader torn down"]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if '"event": "step"' in line]
    assert [s["step"] for s in steps] == [4, 6]


def test_an_epochs_run_reports_its_last_step_before_the_teardown_too(tmp_path, monkeypatch):
    from training.data.feed import DeviceFeed

    order = []
    close, report = DeviceFeed.close, Trainer._report
    monkeypatch.setattr(DeviceFeed, "close", lambda self: (order.append("torn down"), close(self))[1])
    monkeypatch.setattr(Trainer, "_report",
                        lambda self, *a: (order.append(f"report {self.progress.step}"), report(self, *a))[1])
    # 64 samples, 32 a step: two steps an epoch, two epochs; a report every 3 steps.
    Trainer(small_run(tmp_path, "--data.synthetic_samples=64", "--train.epochs=2", "--train.max_steps=null",
                      "--train.log_every_steps=3", "--eval.enabled=false")).run()
    assert order == ["torn down", "report 3", "report 4", "torn down"]


@pytest.mark.parametrize("every", [4, 0])
def test_garbage_is_collected_every_few_steps_and_python_decides_again_afterwards(tmp_path, every):
    import gc

    trainer = Trainer(small_run(tmp_path, "--train.max_steps=8", f"--train.gc_every_steps={every}"))
    paced = []

    def seen(phase, info):  # a collection while the automatic collector is off is one the trainer asked for
        if phase == "start" and trainer.stop.training and not gc.isenabled():
            paced.append((trainer.progress.step, info["generation"]))

    gc.callbacks.append(seen)
    try:
        trainer.run()
    finally:
        gc.callbacks.remove(seen)
    assert paced == ([(4, 1), (8, 1)] if every else [])
    assert gc.isenabled()


def test_a_resume_with_another_sequence_length_counts_the_flops_again(tmp_path, monkeypatch):
    """BERT's second phase resumes the 128-token phase at 512 tokens: a sample then costs ~4x the
    FLOPs, and the figure kept in the checkpoint (counted at 128) would make MFU 4x too low."""
    import training.loop.trainer as trainer_module
    from training.loop.objective import count_training_flops

    def bert(seq_len: int, steps: int):
        return small_run(tmp_path, "--model.name=bert_tiny", f"--data.seq_len={seq_len}", "--data.num_workers=0",
                         "--train.global_batch_size=4", "--train.micro_batch_size=2", f"--train.max_steps={steps}",
                         "--train.log_every_steps=2", "--train.precision=fp32")

    Trainer(bert(16, 2)).run()
    first = torch.load(tmp_path / "checkpoints" / "step-000000002.pt", weights_only=True)["flops_per_sample"]
    counted = []

    def counting(config):
        counted.append(config.data.seq_len)
        return count_training_flops(config)

    monkeypatch.setattr(trainer_module, "count_training_flops", counting)
    resumed = Trainer(bert(64, 4))
    assert resumed.resumed_from == 2
    resumed.run()
    assert counted == [64]  # counted again, once, for the new length
    fresh = count_training_flops(bert(64, 4))
    assert resumed.flops_per_sample == fresh and fresh > 3 * first
    saved = torch.load(tmp_path / "checkpoints" / "step-000000004.pt", weights_only=True)
    assert saved["flops_per_sample"] == fresh and saved["flops_counted_for"]["data.seq_len"] == 64

    # Resumed again at the same length: the figure in the checkpoint is the one for it.
    counted.clear()
    Trainer(bert(64, 6)).run()
    assert counted == []


def test_throughput_counts_the_real_samples_of_an_epochs_short_last_batch(tmp_path):
    """48 samples, 32 a step: each epoch's second step trains 16 real samples and 16 of padding
    (weight 0). Samples/s counts the 16, in the step lines and in the finished event."""
    Trainer(small_run(tmp_path, "--data.synthetic_samples=48", "--train.epochs=2", "--train.max_steps=null",
                      "--train.log_every_steps=1", "--train.precision=fp32", "--model.image_size=32")).run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    # samples/s × seconds per step: the samples each one-step window trained (both from one clock reading).
    trained = [r["samples_per_s"] * r["step_time_s"] for r in steps]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert trained == [pytest.approx(n, rel=0.2) for n in (32, 16, 32, 16)]
    (finished,) = [r for r in records if r["event"] == "finished"]
    assert finished["samples_per_s"] * (finished["elapsed_s"] - finished["eval_s"]) == pytest.approx(96, rel=0.05)
