"""What training minimizes and how fast: the per-sample loss, the learning-rate schedule, and the
FLOPs of one sample's step (for MFU)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from training.config import TrainConfig
from training.loop.metrics import training_flops_per_sample
from training.models import build_model


def per_sample_loss(model: nn.Module, inputs: Tensor, target: Tensor, masked_lm: bool,
                    max_predictions: int | None = None, attention_mask: Tensor | None = None) -> Tensor:
    """Loss per sample; a masked-LM sample's loss is the mean over its masked tokens, computed by
    the model at ``max_predictions`` gathered positions per sequence (``data.masked_per_sequence``;
    see BertForMaskedLM.forward), with attention kept off padding by ``attention_mask``
    (``training.data.datasets.attention_mask``), through DDP's forward, so gradients are reduced."""
    if masked_lm:
        return model(inputs, attention_mask=attention_mask, labels=target, per_sample=True,
                     max_predictions=max_predictions)
    return nn.functional.cross_entropy(model(inputs).float(), target, reduction="none")


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
