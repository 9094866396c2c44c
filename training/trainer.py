"""The elastic training loop: resume, fixed global batch, checkpoint, stop cleanly, report.

Every (re)start of the worker group runs :func:`train` from the top: it reads its rank and
world size afresh, loads the newest complete checkpoint, and goes on from the exact sample
where that checkpoint stopped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import default_collate

from training import elastic
from training.checkpoint import CheckpointManager
from training.config import TrainConfig
from training.data import DataError, Keyed, build_dataset, build_loader
from training.device import Runtime, detect, move
from training.launch import STOP_BUDGET_ENV
from training.metrics import MetricsWriter, training_flops_per_sample
from training.models import build_model
from training.sampler import ElasticBatchPlan, Layout, MicroBatchSampler, SampleKey, fixed_global_layout

log = logging.getLogger(__name__)
# Exit status of ranks that stopped only because a peer was told to: torchrun must restart
# them into a new rendezvous round, not treat the job as finished.
EXIT_MEMBERSHIP_CHANGE = 75
# A checkpoint write longer than this share of that budget is warned about.
STOP_BUDGET_SHARE = 0.8


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0
    offset: int = 0  # samples of this epoch's order already trained on
    step: int = 0  # optimizer steps since the start of training
    # Segments [attempt, first_step, end_step) whose steps count; each resume adds one.
    history: list[list[Any]] = field(default_factory=list)


@dataclass
class TrainResult:
    step: int
    loss: float | None
    stopped_by_signal: bool
    elapsed_s: float


def per_sample_loss(model: nn.Module, inputs: Tensor, target: Tensor, masked_lm: bool) -> Tensor:
    """Loss per sample; a masked-LM sample's loss is the mean over its masked tokens."""
    logits = model(inputs)
    if not masked_lm:
        return nn.functional.cross_entropy(logits.float(), target, reduction="none")
    token_loss = nn.functional.cross_entropy(
        logits.float().transpose(1, 2), target, ignore_index=-100, reduction="none"
    )
    masked = (target != -100).float()
    return (token_loss * masked).sum(1) / masked.sum(1).clamp(min=1)


def learning_rate(config: TrainConfig, progress: float, total_steps: int, scale: float) -> float:
    """Linear warm-up, then cosine or constant. ``progress`` in [0, 1] counts samples, so it survives resizes."""
    optim = config.optim
    base = optim.lr * scale
    warmup = min(1.0, optim.warmup_steps / total_steps)
    if progress < warmup:
        return base * max(progress, 1 / total_steps) / warmup
    if optim.schedule == "constant":
        return base
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup or 1))))


class Trainer:
    def __init__(self, config: TrainConfig):
        self.config = config
        self.started = time.perf_counter()
        if "TORCHELASTIC_RUN_ID" in os.environ:
            elastic.die_with_parent()
        self.stop = elastic.StopRequest()
        self.stop.install()
        self.membership = elastic.Membership.from_environment()
        self.runtime: Runtime = detect(config.train.device)
        # The long first timeout covers the very first start only (first broadcast, compilation);
        # a restart resumes from a checkpoint and must notice a dead peer as soon as any step would.
        self.first_start = not CheckpointManager(config.checkpoint.dir).steps()
        elastic.init_process_group(
            self.runtime.backend, self.membership, self.runtime.device,
            config.distributed.startup_timeout_s if self.first_start else config.distributed.timeout_s,
        )
        # Seconds between SIGTERM and SIGKILL, as the launcher was told (the pod's grace less a margin).
        self.stop_budget_s = float(os.environ.get(STOP_BUDGET_ENV, "30"))
        self.spot = elastic.SpotNotice(os.environ.get(elastic.SPOT_NOTICE_ENV) == "imds"
                                       and self.membership.local_rank == 0)
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.metrics = MetricsWriter(self.rank == 0, config.metrics.jsonl_path, config.metrics.tensorboard_dir)

        torch.manual_seed(config.train.seed)  # identical initial weights on every rank
        self.module = build_model(config.model.name, config.model.num_classes, config.model.image_size)
        self.channels_last = config.model.channels_last and not config.model.is_masked_lm
        self.module.to(self.runtime.device)
        if self.channels_last:
            self.module.to(memory_format=torch.channels_last)
        self.optimizer = self._optimizer()
        self.scaler = self.runtime.grad_scaler(config.train.precision)
        self.checkpoints = CheckpointManager(
            config.checkpoint.dir, config.checkpoint.keep_last, config.checkpoint.async_save
        )
        self.progress = Progress()
        self.resumed_from: int | None = None
        self._saved_step: int | None = None
        self._budget_warned = False
        self._resume()
        self.attempt = self._agree_on_attempt_id()
        self.first_step = self.progress.step

        self.model: nn.Module = self.module
        if self.distributed:
            device_ids = [self.runtime.device.index] if self.runtime.kind == "cuda" else None
            self.model = DistributedDataParallel(self.module, device_ids=device_ids)
        if config.model.compile:
            self.model = torch.compile(self.model)

        vocab = getattr(getattr(self.module, "size", None), "vocab", None)
        self.dataset = build_dataset(config, vocab)
        classes = getattr(self.dataset, "classes", None)
        if classes is not None and len(classes) > config.model.num_classes:
            raise DataError(
                f"model.num_classes: got {config.model.num_classes}; allowed: at least {len(classes)}, "
                f"the number of class folders in {config.data.path}"
            )
        self.layout, self.lr_scale, self.global_batch = self._batch_layout()
        self.plan = ElasticBatchPlan(len(self.dataset), self.global_batch, config.train.seed)
        self.sample_log = self._open_sample_log()

    # --- setup -----------------------------------------------------------------------------

    def _optimizer(self) -> torch.optim.Optimizer:
        optim = self.config.optim
        params = self.module.parameters()
        if optim.name == "sgd":
            return torch.optim.SGD(params, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
        return torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)

    def _batch_layout(self) -> tuple[Layout, float, int]:
        train = self.config.train
        if train.batch_policy == "fixed_global":
            return fixed_global_layout(train.global_batch_size, self.world_size, train.micro_batch_size), 1.0, (
                train.global_batch_size
            )
        global_batch = self.world_size * train.micro_batch_size
        return Layout(self.world_size, 1, train.micro_batch_size), global_batch / train.global_batch_size, global_batch

    def _resume(self) -> None:
        found = self.checkpoints.load_latest()
        if found is None:
            return
        step, state = found
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.progress = Progress(**state["progress"])
        rng = state["rng"]
        if self.rank < len(rng):
            _set_rng_state(rng[self.rank])
        else:  # a rank that did not exist when the checkpoint was written
            _seed_all(self.config.train.seed * 1009 + step * 31 + self.rank)
        self.resumed_from = step

    def _agree_on_attempt_id(self) -> str:
        attempt = [uuid.uuid4().hex[:12]]
        if self.distributed:
            dist.broadcast_object_list(attempt, src=0)
        return attempt[0]

    def _open_sample_log(self):
        directory = self.config.metrics.sample_log_dir
        if not directory:
            return None
        Path(directory).mkdir(parents=True, exist_ok=True)
        return open(Path(directory) / f"samples-{self.attempt}-rank{self.rank}.jsonl", "a", buffering=1)  # noqa: SIM115

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> TrainResult:
        cfg = self.config
        self.metrics.event(
            "rendezvous", world_size=self.world_size, restart_count=self.membership.restart_count,
            run_id=self.membership.run_id, attempt=self.attempt, global_batch=self.global_batch,
            micro_batch=self.layout.micro_batch, accumulation=self.layout.accumulation,
            lr_scale=self.lr_scale, device=self.runtime.name,
        )
        if self.lr_scale != 1.0:
            log.warning("batch_policy=scale_lr: global batch %d, learning rate scaled by %.4f",
                        self.global_batch, self.lr_scale)
        self.metrics.event(
            "resume" if self.resumed_from is not None else "start",
            step=self.progress.step, epoch=self.progress.epoch, offset=self.progress.offset,
            checkpoint=str(self.checkpoints.path(self.resumed_from)) if self.resumed_from is not None else None,
        )
        flops_per_sample = self._count_flops() if self.rank == 0 else None
        total_steps = cfg.train.max_steps
        last_loss: float | None = None
        window = _Window()
        stopped = False
        while self.progress.epoch < cfg.train.epochs and not self._reached(total_steps):
            loader = build_loader(
                self.dataset,
                MicroBatchSampler(self.plan, self.progress.epoch, self.progress.offset, self.rank, self.layout),
                cfg,
                pin_memory=self.runtime.kind == "cuda",
            )
            batches = iter(loader)
            while self.progress.offset < self.plan.dataset_size and not self._reached(total_steps):
                loss, data_wait, step_time = self._step(batches)
                window.add(loss, data_wait, step_time)
                if (self.distributed and self.first_start
                        and self.progress.step - self.first_step == cfg.distributed.warmup_steps):
                    elastic.shorten_timeout(cfg.distributed.timeout_s)
                stop_now, notice = elastic.any_rank(self.stop.requested, self.spot.pending,
                                                    device=self._flag_device())
                if self.progress.step % cfg.train.log_every_steps == 0:
                    last_loss = self._report(window, flops_per_sample)
                if stop_now:
                    self._save(synchronous=True, reason="stop")
                    stopped = True
                    break
                if notice:
                    self.spot.acted()
                    self._save(synchronous=True, reason="spot-notice")
                elif self.progress.step % cfg.checkpoint.interval_steps == 0:
                    self._save(synchronous=False)
            del batches, loader
            if stopped:
                break
            if self.progress.offset >= self.plan.dataset_size:
                self.progress.epoch += 1
                self.progress.offset = 0
        if not stopped:
            if window.steps:
                last_loss = self._report(window, flops_per_sample)
            if self._saved_step != self.progress.step:
                self._save(synchronous=True)
        self.checkpoints.wait()
        self.metrics.event("stop" if stopped else "finished", step=self.progress.step,
                           signal=self.stop.signal_name, by_peer=stopped and not self.stop.requested)
        self.metrics.close()
        if self.sample_log:
            self.sample_log.close()
        return TrainResult(self.progress.step, last_loss, stopped, time.perf_counter() - self.started)

    def _reached(self, total_steps: int | None) -> bool:
        return total_steps is not None and self.progress.step >= total_steps

    def _flag_device(self) -> torch.device:
        return self.runtime.device if self.runtime.backend == "nccl" else torch.device("cpu")

    def _step(self, batches) -> tuple[Tensor, float, float]:
        cfg = self.config
        started = time.perf_counter()
        if cfg.train.max_steps:
            total_steps, done = cfg.train.max_steps, self.progress.step / cfg.train.max_steps
        else:
            total_steps = cfg.train.epochs * self.plan.steps_per_epoch
            done = (self.progress.epoch * self.plan.dataset_size + self.progress.offset) / (
                cfg.train.epochs * self.plan.dataset_size
            )
        lr = learning_rate(cfg, done, total_steps, self.lr_scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        real = self.plan.real_samples(self.progress.offset)
        # Each rank's loss is scaled so that DDP's mean over ranks gives the mean over the real
        # samples of the global batch, whatever the world size and the padding.
        scale = self.world_size / real
        loss_sum = torch.zeros((), device=self.runtime.device)
        data_wait = 0.0
        ids: list[int] = []
        for micro in range(self.layout.accumulation):
            wait_started = time.perf_counter()
            inputs, target, index, weight = next(batches)
            data_wait += time.perf_counter() - wait_started
            if self.sample_log:
                ids += index[weight > 0].tolist()
            inputs, target, weight = move((inputs, target, weight), self.runtime, self.channels_last)
            final = micro == self.layout.accumulation - 1
            no_sync = self.model.no_sync() if self.distributed and not final else contextlib.nullcontext()
            with no_sync:
                with self.runtime.autocast(cfg.train.precision):
                    losses = per_sample_loss(self.model, inputs, target, self.config.model.is_masked_lm)
                loss = (losses * weight.to(losses.dtype)).sum() * scale
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach() / self.world_size
        if cfg.optim.grad_clip_norm:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.module.parameters(), cfg.optim.grad_clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.runtime.mark_step()
        if self.sample_log:
            self.sample_log.write(
                f'{{"attempt": "{self.attempt}", "step": {self.progress.step}, "epoch": {self.progress.epoch}, '
                f'"ids": {ids}}}\n'
            )
        self.progress.step += 1
        self.progress.offset += self.global_batch
        return loss_sum, data_wait, time.perf_counter() - started

    def _report(self, window: "_Window", flops_per_sample: float | None) -> float:
        loss = window.loss_sum
        if self.distributed:
            dist.all_reduce(loss)
        self.runtime.synchronize()
        elapsed = window.time
        mean_loss = float(loss) / window.steps
        samples_per_s = window.steps * self.global_batch / elapsed if elapsed else 0.0
        peak = self.runtime.peak_memory_bytes()
        mfu = None
        if flops_per_sample and self.runtime.peak_flops:
            mfu = samples_per_s * flops_per_sample / (self.runtime.peak_flops * self.world_size)
        self.metrics.step(
            step=self.progress.step, epoch=self.progress.epoch, loss=round(mean_loss, 6),
            lr=self.optimizer.param_groups[0]["lr"], samples_per_s=round(samples_per_s, 2),
            samples_per_s_per_device=round(samples_per_s / self.world_size, 2),
            step_time_s=round(elapsed / window.steps, 4),
            data_wait_pct=round(100 * window.data_wait / elapsed, 2) if elapsed else 0.0,
            peak_memory_gib=round(peak / 2**30, 3) if peak else None,
            world_size=self.world_size, restart_count=self.membership.restart_count,
            mfu=round(mfu, 4) if mfu is not None else None,
        )
        window.reset()
        return mean_loss

    def _count_flops(self) -> float | None:
        """Forward+backward FLOPs of one sample, measured once; gradients are discarded."""
        sample_batch = default_collate([Keyed(self.dataset)[SampleKey(0, 1.0, 0)]])
        inputs, target, _, _ = move(sample_batch, self.runtime, self.channels_last)

        def one_step() -> None:
            with self.runtime.autocast(self.config.train.precision):
                per_sample_loss(self.module, inputs, target, self.config.model.is_masked_lm).sum().backward()

        flops = training_flops_per_sample(one_step, 1)
        self.optimizer.zero_grad(set_to_none=True)
        return flops

    # --- checkpoints -----------------------------------------------------------------------

    def _save(self, synchronous: bool, reason: str = "interval") -> None:
        self._saved_step = self.progress.step
        rng = _rng_state()
        states = [None] * self.world_size if self.rank == 0 else None
        if self.distributed:
            dist.gather_object(rng, states, dst=0)
        else:
            states = [rng]
        if self.rank == 0:
            progress = self.progress
            history = [*progress.history, [self.attempt, self.first_step, progress.step]]
            state = {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "schedule": {"name": self.config.optim.schedule, "base_lr": self.config.optim.lr,
                             "lr_scale": self.lr_scale, "lr": self.optimizer.param_groups[0]["lr"]},
                "progress": {"epoch": progress.epoch, "offset": progress.offset, "step": progress.step,
                             "history": history},
                "rng": states,
                "world_size": self.world_size,
                "global_batch": self.global_batch,
            }
            started = time.perf_counter()
            self.checkpoints.save(progress.step, state)
            if synchronous:
                self.checkpoints.wait()
            # The newest write that finished (this one when synchronous): what a SIGTERM would cost.
            write_s = self.checkpoints.last_write_seconds
            self.metrics.event("checkpoint", step=progress.step, path=str(self.checkpoints.path(progress.step)),
                               blocking_s=round(time.perf_counter() - started, 4), asynchronous=not synchronous,
                               reason=reason, last_write_s=round(write_s, 3), stop_budget_s=self.stop_budget_s)
            if write_s > STOP_BUDGET_SHARE * self.stop_budget_s and not self._budget_warned:
                self._budget_warned = True
                log.warning("a checkpoint takes %.1f s to write, more than %.0f%% of the %.0f s a SIGTERM leaves "
                            "before SIGKILL: raise the pod's grace period or write less", write_s,
                            100 * STOP_BUDGET_SHARE, self.stop_budget_s)
        if synchronous and self.distributed:
            dist.barrier()  # nobody exits before the checkpoint is on disk


class _Window:
    """Sums over one logging interval."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum: Tensor | float = 0.0
        self.steps = 0
        self.data_wait = 0.0
        self.time = 0.0

    def add(self, loss: Tensor, data_wait: float, step_time: float) -> None:
        self.loss_sum = loss if isinstance(self.loss_sum, float) else self.loss_sum + loss
        self.steps += 1
        self.data_wait += data_wait
        self.time += step_time


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def train(config: TrainConfig) -> TrainResult:
    """Run (or resume) training to the end, or until a stop signal; exits 75 when a peer stopped."""
    trainer = Trainer(config)
    try:
        result = trainer.run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if result.stopped_by_signal and not trainer.stop.requested:
        raise SystemExit(EXIT_MEMBERSHIP_CHANGE)
    return result
