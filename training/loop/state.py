"""What a checkpoint holds, named in one place: :class:`TrainState` writes it and is its one reader.

Each component keeps its own part: the model, optimizer and grad scaler their ``state_dict``,
:class:`Progress` where training stands, :func:`rng_state` each rank's generators. The file is
a plain dict of tensors and built-in values (``torch.load(weights_only=True)`` reads it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from training.config import TrainConfig
from training.model_names import IMAGE_MODELS


@dataclass
class Progress:
    """Where training stands."""

    epoch: int = 0
    offset: int = 0  # samples of this epoch's order already trained on
    step: int = 0  # optimizer steps since the start of training
    # Segments [attempt, first_step, end_step) whose steps count; each resume adds one.
    history: list[list[Any]] = field(default_factory=list)
    bad_samples: int = 0  # samples skipped because they could not be read, over the whole run
    # The step last evaluated at (training/loop/evaluate.py); a checkpoint written at a step due
    # for evaluation before it ran (a stop) has an older one, and the resumed job makes it up.
    evaluated_step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "step": self.step, "history": self.history,
                "bad_samples": self.bad_samples, "evaluated_step": self.evaluated_step}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "Progress":
        return cls(**state)

    def closing(self, attempt: str, first_step: int) -> "Progress":
        """This progress with the current attempt's segment, [attempt, first_step, step), recorded."""
        return replace(self, history=[*self.history, [attempt, first_step, self.step]])


@dataclass
class TrainState:
    """One checkpoint's contents."""

    signature: dict[str, Any]  # what a job must share with the checkpoint to resume it (see mismatch)
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scaler: dict[str, Any]  # empty unless fp16 training scales its gradients
    progress: Progress
    rng: list[dict[str, Any]]  # every rank's generators, in rank order (rng_state)
    flops_per_sample: float | None  # counted once per run, not again at each restart
    # The world and schedule that wrote it: a resume may change all three (the resume event says so).
    world_size: int
    global_batch: int
    schedule: dict[str, Any]
    # What flops_per_sample was counted for (flops_key): a resume with another sequence length
    # (BERT's 128 -> 512 phase) or image size counts again rather than keep a figure 4x off.
    flops_counted_for: dict[str, Any] = field(default_factory=dict)

    def flops_for(self, key: dict[str, Any]) -> float | None:
        """The FLOPs per sample kept here if they were counted for ``key``, else None (count again)."""
        return self.flops_per_sample if self.flops_counted_for == key else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "signature": self.signature, "model": self.model, "optimizer": self.optimizer, "scaler": self.scaler,
            "schedule": self.schedule, "progress": self.progress.state_dict(), "rng": self.rng,
            "world_size": self.world_size, "global_batch": self.global_batch, "flops_per_sample": self.flops_per_sample,
            "flops_counted_for": self.flops_counted_for,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "TrainState":
        """Read what :meth:`state_dict` wrote (call :func:`mismatch` first on a file not known to fit)."""
        return cls(
            signature=state.get("signature") or {}, model=state["model"], optimizer=state["optimizer"],
            scaler=state.get("scaler") or {}, progress=Progress.from_state_dict(state["progress"]),
            rng=state["rng"], flops_per_sample=state.get("flops_per_sample"),
            world_size=state.get("world_size", len(state["rng"])), global_batch=state.get("global_batch", 0),
            schedule=state.get("schedule") or {}, flops_counted_for=state.get("flops_counted_for") or {},
        )


def signature(config: TrainConfig) -> dict[str, Any]:
    """What a checkpoint must share with the job of ``config`` to be resumed by it."""
    model = config.model
    found: dict[str, Any] = {"model.name": model.name, "model.num_classes": model.num_classes,
                             "optim.name": config.optim.name}
    if model.name in IMAGE_MODELS:
        found["model.image_size"] = model.image_size
    return found


def flops_key(config: TrainConfig) -> dict[str, Any]:
    """Everything count_training_flops (training/loop/objective.py) counts one sample's FLOPs from."""
    model, data = config.model, config.data
    return {"model.name": model.name, "model.num_classes": model.num_classes, "model.image_size": model.image_size,
            "data.seq_len": data.seq_len, "data.masked_per_sequence": data.masked_per_sequence}


def mismatch(state: dict[str, Any], signature: dict[str, Any], model: dict[str, torch.Tensor]) -> str | None:
    """How a checkpoint's ``state`` differs from a job with this ``signature`` and this model's
    ``state_dict``, in words; None when it fits."""
    saved = state.get("signature")
    if isinstance(saved, dict):
        differences = [f"{key} {saved.get(key)!r} there, {value!r} here"
                       for key, value in signature.items() if saved.get(key) != value]
        if differences:
            return "; ".join(differences)
    weights = state.get("model")
    if not isinstance(weights, dict):
        return "it holds no model weights"
    missing = [key for key in model if key not in weights]
    unexpected = [key for key in weights if key not in model]
    if missing or unexpected:
        example = (missing or unexpected)[0]
        return f"{len(missing)} tensor(s) missing and {len(unexpected)} unexpected, e.g. {example}"
    for key, tensor in model.items():
        if tuple(weights[key].shape) != tuple(tensor.shape):
            return f"{key} has shape {list(weights[key].shape)} there, {list(tensor.shape)} here"
    return None


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain values, loadable with ``weights_only=True``."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    # Generators need a tensor of their own: a received state is a view into a broadcast bucket.
    torch.set_rng_state(state["torch"].cpu().clone())
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].cpu().numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu().clone())


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
