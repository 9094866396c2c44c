"""Throughput of the trainer against a bare forward/backward/step loop on the same model and batch.

Both run in this one process, alternately, so that machine noise hits both alike. The bare
loop reuses one batch that already sits on the device; the trainer reads its data through the
sampler and DataLoader, weights the loss, checks for stop requests and keeps metrics. The ratio
is what all of that costs.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch

from training.config import TrainConfig, masked_per_sequence
from training.data.feed import move
from training.device import detect
from training.models import build_model
from training.loop.compile import compile_with_fallback, should_compile
from training.loop.objective import per_sample_loss
from training.loop.optimizer import build_optimizer
from training.loop.trainer import Trainer


@dataclass
class Comparison:
    model: str
    micro_batch: int
    device: str
    trainer: list[float] = field(default_factory=list)  # samples/s per repeat
    bare: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.median(self.trainer) / statistics.median(self.bare)

    def table(self) -> str:
        return "\n".join([
            f"model {self.model}, batch {self.micro_batch}, device {self.device}",
            f"  bare loop  samples/s median {statistics.median(self.bare):10.2f}  runs {self.bare}",
            f"  trainer    samples/s median {statistics.median(self.trainer):10.2f}  runs {self.trainer}",
            f"  trainer / bare = {self.ratio:.3f}",
        ])

    def as_json(self) -> str:
        return json.dumps({"model": self.model, "batch": self.micro_batch, "device": self.device,
                           "trainer": self.trainer, "bare": self.bare, "ratio": round(self.ratio, 4)})


def bare_loop(config: TrainConfig, steps: int, warmup: int, losses: list[torch.Tensor] | None = None,
              ddp: bool = False) -> float:
    """Samples/s of zero_grad/forward/backward/step on one batch already on the device; each
    step's loss is appended to ``losses`` when given (no host sync). ``ddp``: in a torchrun worker,
    the model is wrapped in DistributedDataParallel over torchrun's process group (NCCL on a GPU),
    as a bare DDP program would be."""
    runtime = detect(config.train.device)
    torch.manual_seed(config.train.seed)
    model = build_model(config.model.name, config.model.num_classes, config.model.image_size).to(runtime.device)
    channels_last = config.model.channels_last and not config.model.is_masked_lm
    if channels_last:
        model.to(memory_format=torch.channels_last)
    optimizer = reference_optimizer(model, config)
    if ddp:
        import torch.distributed as dist

        dist.init_process_group("nccl" if runtime.device.type == "cuda" else "gloo")
        device_ids = [runtime.device] if runtime.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if should_compile(config, runtime.kind):  # the trainer's rule, so both sides compile or neither
        model = compile_with_fallback(model)
    trainer_like = _single_batch(config)
    inputs, target = move(trainer_like, runtime, channels_last)
    batch = config.train.micro_batch_size
    for i in range(warmup + steps):
        if i == warmup:
            runtime.synchronize()
            started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with runtime.autocast(runtime.precision(config.train.precision)):
            loss = per_sample_loss(model, inputs, target, config.model.is_masked_lm,
                                   config.data.masked_per_sequence).mean()
        loss.backward()
        optimizer.step()
        if losses is not None:
            losses.append(loss.detach())
    runtime.synchronize()
    rate = steps * batch / (time.perf_counter() - started)
    if ddp:
        import torch.distributed as dist

        dist.destroy_process_group()
    return rate


def reference_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """The trainer's optimizer for ``config``, built by the trainer's own builder
    (training/loop/optimizer.py: the same class, parameter groups, momentum or betas and weight
    decay), at learning rate 0.

    Learning rate 0: the step does all its work (momentum or moments, weight decay, the update),
    but the weights stay put. Trained on its one batch, the loop would drive loss and gradients
    toward zero, into subnormal floats, which x86 cores compute many times slower: an MLP's loop
    on one CPU thread fell from 6,300 to 2,300 samples/s within 200 steps, a reference that slows
    down and flatters the trainer, whose batches are always new. GPUs compute subnormals at full
    speed. AdamW too leaves the weights as they are at rate 0: its decoupled weight decay is
    ``param.mul_(1 - lr * weight_decay)`` and its update is scaled by ``lr / bias_correction1``
    (torch/optim/adam.py, _single_tensor_adam and _multi_tensor_adam, which AdamW runs with
    decoupled_weight_decay=True: torch/optim/adamw.py, v2.13.0). The rate is set per group after
    building, as the trainer's schedule sets it every step.
    """
    optimizer = build_optimizer(model, config.optim)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    return optimizer


def _single_batch(config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    from training.data.datasets import build_dataset
    from training.data.sampler import SampleKey

    vocab = build_model(config.model.name).size.vocab if config.model.is_masked_lm else None
    dataset = build_dataset(config, vocab)
    samples = [dataset[SampleKey(i, 1.0, i)] for i in range(config.train.micro_batch_size)]
    inputs = torch.stack([s[0] for s in samples])
    target = torch.stack([s[1] for s in samples]) if config.model.is_masked_lm else torch.tensor([s[1] for s in samples])
    return inputs, target


def trainer_loop(config: TrainConfig, steps: int, warmup: int) -> float:
    """Samples/s over ``steps`` steps after ``warmup``, by wall clock between the trainer's
    reports: each report synchronizes the device first, as the bare loop does around its steps.
    The window includes data loading, loss weighting, the stop check and the report itself."""
    with tempfile.TemporaryDirectory() as scratch:
        config = config.model_copy(update={
            "train": config.train.model_copy(update={
                "max_steps": warmup + steps, "log_every_steps": 1 if warmup == 0 else warmup,
                "global_batch_size": config.train.micro_batch_size, "batch_policy": "fixed_global"}),
            "checkpoint": config.checkpoint.model_copy(update={"dir": scratch, "interval_steps": 10**9}),
            "metrics": config.metrics.model_copy(update={"jsonl_path": f"{scratch}/metrics.jsonl"}),
            "eval": config.eval.model_copy(update={"enabled": False}),  # validation's time is not measured
        })
        with contextlib.redirect_stdout(io.StringIO()):
            Trainer(config).run()
        with open(f"{scratch}/metrics.jsonl") as lines:
            records = [json.loads(line) for line in lines]
    reports = [r for r in records if r["event"] == "step"]  # at step warmup, then warmup + steps
    first, last = reports[0], reports[-1]
    return (last["step"] - first["step"]) * config.train.micro_batch_size / (last["time"] - first["time"])


def compare_with_bare_loop(config: TrainConfig, steps: int, warmup: int, repeats: int) -> Comparison:
    """Alternating runs of the bare loop and the trainer, so that machine noise hits both alike."""
    result = Comparison(config.model.name, config.train.micro_batch_size, detect(config.train.device).name)
    for _ in range(repeats):
        result.bare.append(round(bare_loop(config, steps, warmup), 2))
        result.trainer.append(round(trainer_loop(config, steps, warmup), 2))
    return result


# --- BERT's masked-LM head: every position against the masked ones ---------------------------


def _mlm_every_position(model, tokens, labels):
    logits = model(tokens)
    token_loss = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100,
                                                   reduction="none")
    return token_loss.sum(1)  # each sequence's sum over its masked tokens, as the trainer's head gives it


def _mlm_masked_only(model, tokens, labels, max_predictions):
    return model(tokens, labels=labels, per_sample=True, max_predictions=max_predictions)


def compare_mlm_heads(name: str, batch: int, seq_len: int, repeats: int, device: torch.device,
                      precision: str = "fp32") -> dict[str, float]:
    """Median seconds of one forward+backward with the vocabulary projection at every position
    and at the masked ones only, interleaved; each timed point follows a device sync."""
    runtime = detect(device.type)
    torch.manual_seed(0)
    model = build_model(name).to(device)
    tokens = torch.randint(0, model.size.vocab, (batch, seq_len), device=device)
    # As mask_tokens masks a full sequence (no padding): the same number of positions in every one.
    count = masked_per_sequence(seq_len, 0.15)
    chosen = torch.rand(tokens.shape, device=device).topk(count, dim=1).indices
    labels = torch.full_like(tokens, -100).scatter(1, chosen, tokens.gather(1, chosen))
    times: dict[str, list[float]] = {"every position": [], "masked only": []}
    steps = (("every position", _mlm_every_position),
             ("masked only", functools.partial(_mlm_masked_only, max_predictions=count)))
    for i in range(repeats + 1):  # the first round warms up; interleaved, so drift hits both alike
        for label, step in steps:
            model.zero_grad(set_to_none=True)
            runtime.synchronize()
            started = time.perf_counter()
            with runtime.autocast(precision):
                loss = step(model, tokens, labels).sum()
            loss.backward()
            runtime.synchronize()
            if i:
                times[label].append(time.perf_counter() - started)
    return {label: statistics.median(values) for label, values in times.items()}
