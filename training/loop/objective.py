"""What training minimizes and how fast: the per-sample loss, the learning-rate schedule, and the
FLOPs of one sample's step (for MFU)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from training.config import TrainConfig
from training.data.datasets import IGNORE_LABEL
from training.loop.metrics import training_flops_per_sample
from training.models import build_model


def per_sample_loss(model: nn.Module, inputs: Tensor, target: Tensor, masked_lm: bool,
                    max_predictions: int | None = None, attention_mask: Tensor | None = None,
                    label_smoothing: float = 0.0) -> Tensor:
    """Loss per sample: an image's cross-entropy (against labels smoothed by ``label_smoothing``,
    as torch's ``cross_entropy`` smooths them); a masked-LM sequence's *sum* over its masked
    tokens, which :func:`global_loss_scale` divides by the global batch's count of them. The
    model computes it at ``max_predictions`` gathered positions per sequence
    (``data.masked_per_sequence``; see BertForMaskedLM.forward), with attention kept off padding
    by ``attention_mask`` (``training.data.datasets.attention_mask``), through DDP's forward, so
    gradients are reduced."""
    if masked_lm:
        return model(inputs, attention_mask=attention_mask, labels=target, per_sample=True,
                     max_predictions=max_predictions, label_smoothing=label_smoothing)
    return nn.functional.cross_entropy(model(inputs).float(), target, reduction="none",
                                       label_smoothing=label_smoothing)


def masked_tokens(batch: Any) -> Tensor:
    """The masked tokens of a micro-batch's real samples (padding has weight 0), on its device."""
    labelled = (batch.target != IGNORE_LABEL).sum(dim=1).to(batch.weight.dtype)
    return (labelled * batch.weight).sum()


def global_loss_scale(batches: list[Any] | None, real_samples: int, world_size: int) -> float | Tensor:
    """What each rank multiplies the weighted sum of its per-sample losses by, so that DDP's mean
    over ranks makes the step's loss the global batch's.

    Images (``batches`` None): the mean over the global batch's ``real_samples``. A masked LM (the
    step's micro-batches of this rank in ``batches``): the mean over every masked token of the
    global batch, not a mean of per-sequence means (sequences differ in their counts: padded rows
    mask fewer). That is the loss of reference BERT over its batch (google-research/bert,
    run_pretraining.py, ``get_masked_lm_output``: the label-weighted sum over the label weights'
    sum) and of transformers' BertForMaskedLM (5.23, models/bert/modeling_bert.py:
    CrossEntropyLoss over all labels not -100) given the whole global batch at once. The count
    is summed over the micro-batches and the ranks before any loss is scaled, as Hugging Face's
    Trainer counts ``num_items_in_batch`` for gradient accumulation (trainer.py,
    ``get_batch_samples``, ``_get_num_items_in_batch`` with ``average_tokens_across_devices``,
    whose ``compute_loss`` then multiplies by the process count as ``world_size`` does here).
    One scalar all-reduce, left on the device: the host does not wait for it.
    """
    if batches is None:
        return world_size / real_samples
    count = sum(masked_tokens(batch) for batch in batches)
    if world_size > 1:
        dist.all_reduce(count)
    return world_size / count.clamp(min=1)


def learning_rate(config: TrainConfig, progress: float, total_steps: int, scale: float) -> float:
    """Linear warm-up from 0, then cosine, linear or constant.

    Hugging Face's ``get_{cosine,linear,constant}_schedule_with_warmup`` (transformers 5.23,
    optimization.py: ``_get_linear_schedule_with_warmup_lr_lambda`` and its siblings) step for
    step, with the step's position measured by ``progress`` in [0, 1], the share of the run's
    samples trained, so that it survives resizes: progress × ``total_steps`` is their step.
    """
    optim = config.optim
    base = optim.lr * scale
    warmup = min(1.0, optim.warmup_steps / total_steps)
    if progress < warmup:
        return base * progress / warmup
    if optim.schedule == "constant":
        return base
    decayed = min(1.0, (progress - warmup) / (1 - warmup or 1))
    if optim.schedule == "linear":
        return base * max(0.0, 1 - decayed)
    return base * 0.5 * (1 + math.cos(math.pi * decayed))


def count_training_flops(config: TrainConfig) -> float | None:
    """Forward+backward FLOPs per sample of ``config``'s model, on the meta device (two samples, so
    BatchNorm in training mode has more than one value per channel even at 16 px)."""
    model_config = config.model
    with torch.device("meta"):
        model = build_model(model_config.name, model_config.num_classes, model_config.image_size)
        if model_config.is_masked_lm:
            inputs = torch.zeros(2, config.data.seq_len, dtype=torch.long)
            target = torch.zeros(2, config.data.seq_len, dtype=torch.long)
        else:
            inputs = torch.zeros(2, 3, model_config.image_size, model_config.image_size)
            target = torch.zeros(2, dtype=torch.long)

    def one_step() -> None:
        # The same loss as training: for a masked LM, the vocabulary projection at the gathered
        # positions only (their count does not depend on the labels' values, so meta can run it).
        losses = per_sample_loss(model, inputs, target, model_config.is_masked_lm, config.data.masked_per_sequence)
        losses.sum().backward()

    return training_flops_per_sample(one_step, 2)
