"""The trainer's typed config: a YAML file plus dotted command-line overrides.

``python -m training train --config job.yaml --optim.lr=0.2 --train.precision bf16``.
Unknown keys and bad values are one line each, naming the field and what is allowed.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from training.contract import checkpoint_dir
from training.model_names import IMAGE_MODELS, MASKED_LM_MODELS, MODEL_NAMES
from typed_config import ConfigError, FieldProblem, StrictModel, format_errors, read_yaml_mapping, show, validate

Positive = Field(gt=0)
# torchvision's ResNet-50 recipe since v0.11 (IMAGENET1K_V2 weights): --label-smoothing 0.1, passed
# to nn.CrossEntropyLoss (references/classification/train.py). NVIDIA's ResNet-50 v1.5 recipe
# (DeepLearningExamples) and "Bag of Tricks" (He et al. 2019) smooth by 0.1 too, with a cosine
# schedule as ours.
IMAGE_LABEL_SMOOTHING = 0.1


class ModelSection(StrictModel):
    name: str = "resnet50"
    num_classes: int = Field(1000, gt=1)
    image_size: int = Field(224, ge=16)
    # NHWC convolutions: faster on tensor cores with bf16/fp16; ignored for masked-LM models.
    channels_last: bool = True
    # torch.compile: null (auto) compiles image models on a GPU, where it pays; true or false force
    # it. A frame the compiler cannot handle runs eagerly instead (one line in the log).
    compile: bool | None = None

    @model_validator(mode="after")
    def _known(self):
        if self.name not in MODEL_NAMES:
            raise FieldProblem("name", self.name, ", ".join(MODEL_NAMES))
        return self

    @property
    def is_masked_lm(self) -> bool:
        return self.name in MASKED_LM_MODELS


def masked_per_sequence(length: int, probability: float) -> int:
    """How many of a sequence's ``length`` tokens BERT masks: ``probability`` of them, rounded,
    at least one (google-research/bert, create_pretraining_data.py: ``num_to_predict``). A fixed
    count lets the MLM head gather the masked positions in static shapes (``max_predictions``)."""
    return max(1, round(length * probability))


class DataSection(StrictModel):
    # synthetic: generated per sample id; imagefolder: <path>/<class>/<image>; mlm_shards: <path>/*.npy
    kind: Literal["synthetic", "imagefolder", "mlm_shards"] = "synthetic"
    path: str | None = None
    synthetic_samples: int = Field(1_281_167, gt=0)
    # synthetic: at most this many training samples a second from each process that reads (the trainer, or
    # each loader worker), as from storage of that bandwidth. A run slower than the cap is not
    # slowed; a faster one steps at the cap whatever the machine, so a drill or benchmark lasts as
    # long as planned and leaves the cores it does not need idle. None: as fast as generated.
    synthetic_samples_per_s: float | None = Field(None, gt=0)
    seq_len: int = Field(128, ge=8)
    mask_probability: float = Field(0.15, gt=0, lt=1)
    num_workers: int = Field(8, ge=0)
    prefetch_factor: int = Field(4, gt=0)
    # Where JPEGs (imagefolder) are decoded. loader: Pillow in the workers. device: the workers
    # only read the files; nvJPEG decodes each batch on the GPU (Pillow in the training process
    # on CPU). loader is the default: on an H100 with 12 workers it fed ResNet-50 at 0.98 of the
    # bare loop, device at 0.52-0.66 (docs/performance.md).
    decode: Literal["loader", "device"] = "loader"
    # Samples that cannot be read (a corrupt JPEG, a truncated shard) are skipped, named in the
    # log and counted over the whole run; more than this ends it (exit 78).
    max_bad_samples: int = Field(100, ge=0)

    @property
    def masked_per_sequence(self) -> int:
        """Masked positions per sequence of a masked-LM run (also the MLM head's ``max_predictions``)."""
        return masked_per_sequence(self.seq_len, self.mask_probability)

    @model_validator(mode="after")
    def _path_when_read_from_disk(self):
        if self.kind != "synthetic" and not self.path:
            raise FieldProblem("path", self.path, f"a directory on the shared file system for kind {self.kind}")
        return self

    @model_validator(mode="after")
    def _pace_for_synthetic_data_only(self):
        if self.kind != "synthetic" and self.synthetic_samples_per_s is not None:
            raise FieldProblem("synthetic_samples_per_s", self.synthetic_samples_per_s,
                               f"unset for kind {self.kind} (it paces synthetic data only)")
        return self


class OptimSection(StrictModel):
    name: Literal["sgd", "adamw"] = "sgd"
    # The learning rate for train.global_batch_size samples per step.
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(1e-4, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    # Steps of linear warm-up from 0 (step 0 trains at rate 0, as Hugging Face's schedules do).
    warmup_steps: int = Field(0, ge=0)
    # After the warm-up: cosine or linear decay to 0 at the end of the run, or constant; each
    # Hugging Face's get_{cosine,linear,constant}_schedule_with_warmup (transformers 5.23,
    # optimization.py), positioned by samples trained so that it survives resizes.
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    grad_clip_norm: float | None = Field(None, gt=0)
    # Biases and normalization layers' weights are not decayed, as Hugging Face's Trainer
    # (get_decay_parameter_names) and torchvision's recipes since v0.11 (--norm-weight-decay 0.0)
    # leave them. true decays every parameter (torchvision's original ResNet recipe).
    decay_norms_and_biases: bool = False


class TrainSection(StrictModel):
    global_batch_size: int = Field(256, gt=0)
    # Per device and micro-step; the trainer accumulates to reach global_batch_size.
    micro_batch_size: int = Field(32, gt=0)
    # fixed_global: same global batch at every world size (gradient accumulation).
    # scale_lr: one micro-batch per device per step, learning rate scaled linearly and logged.
    batch_policy: Literal["fixed_global", "scale_lr"] = "fixed_global"
    epochs: int = Field(90, gt=0)
    max_steps: int | None = Field(None, gt=0)
    # auto: bf16 where the device computes it natively (CUDA compute capability 8.0 and up:
    # A100, A10G, L4, H100; CPU; Trainium), else fp16 with loss scaling (V100, T4).
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # The cross-entropy is taken against labels smoothed by this much (torch's label_smoothing);
    # none: 0.1 for image models (torchvision's ResNet-50 recipe since v0.11, --label-smoothing
    # 0.1), 0 for masked-LM models (BERT's recipe has none).
    label_smoothing: float | None = Field(None, ge=0, lt=1)
    device: Literal["auto", "cuda", "cpu", "neuron"] = "auto"
    seed: int = 0
    log_every_steps: int = Field(10, gt=0)
    # Python's cyclic garbage collector runs every this many steps (its young generations only,
    # as torchtitan's training.gc_freq does), not whenever allocations cross its threshold: a
    # collection at a random point of a step stalls its launches, on one rank stalls them all
    # (one collection in the trainer's process on an H100 took up to 0.29 s). 0: Python decides.
    gc_every_steps: int = Field(50, ge=0)


class CheckpointSection(StrictModel):
    dir: str = checkpoint_dir("default")
    # The most steps a kill can cost: an asynchronous write starts early enough to be on disk by then.
    interval_steps: int = Field(500, gt=0)
    keep_last: int = Field(3, gt=0)
    # Copy to host memory in the step loop, write to the file system in the background.
    async_save: bool = True
    # Where files are written before their rename into dir: the same file system, outside the
    # S3-linked tree (the charts use /fsx/staging/<job>). Default: dir/.staging.
    staging_dir: str | None = None
    # When no checkpoint in dir can be read, or the newest does not fit this model and optimizer:
    # fail (say so in one line, exit 78) or start_fresh (move them to dir/set-aside/<time>/, start at 0).
    if_unusable: Literal["fail", "start_fresh"] = "fail"
    # The slowest rate (MB/s) at which rank 0 may read or write a checkpoint while the other ranks
    # wait for it, outside any collective (so not bound by distributed.timeout_s): they give up
    # after the checkpoint's size at this rate plus a minute (training/loop/rank_zero_io.py).
    min_throughput_mb_s: float = Field(50, gt=0)


class DistributedSection(StrictModel):
    # First rendezvous, model broadcast and compilation can be slow; then a peer that stops
    # answering (a frozen node keeps its sockets open) must fail the step quickly.
    startup_timeout_s: int = Field(900, gt=0)
    timeout_s: int = Field(120, gt=0)
    warmup_steps: int = Field(20, ge=0)
    # NCCL workers keep their state through a lost peer, as gloo workers do (training/loop/lost_peer.py).
    # Off until the GPU acceptance check's lost-node case passes (benchmarks/gpu_check.py): on an H100
    # the first try fell back to the restart from the checkpoint. Off: NCCL workers restart from it.
    nccl_recovery: bool = False


class MetricsSection(StrictModel):
    # What rank 0 prints: a progress line per report for people (auto: when stdout is a
    # terminal), or JSON lines for machines (auto: otherwise, e.g. in a pod). jsonl_path always
    # gets JSON lines.
    stdout: Literal["auto", "progress", "json"] = "auto"
    jsonl_path: str | None = None
    tensorboard_dir: str | None = None
    # Debugging and tests: each rank appends the sample ids of every micro-batch here.
    sample_log_dir: str | None = None
    # A rank whose own step time (its input wait and forward passes, training/loop/stragglers.py) is
    # over the median's by this fraction in this many reports in a row is named in a straggler event.
    straggler_margin: float = Field(0.25, gt=0)
    straggler_windows: int = Field(2, ge=1)
    # report: name it. replace: also replace its node, one at a time and never below the job's
    # --nnodes minimum (training/loop/replacement.py); under the platform's job charts, the job spec's
    # straggler_policy sets this and gives the pods what tainting their node needs.
    straggler_policy: Literal["report", "replace"] = "report"


# ILSVRC-2012: training and validation images; a synthetic held-out split keeps their proportion.
IMAGENET_TRAIN_IMAGES, IMAGENET_VAL_IMAGES = 1_281_167, 50_000


class EvalSection(StrictModel):
    # Validation (training/loop/evaluate.py): top-1 and top-5 for image models, masked-LM accuracy
    # and loss for BERT, every sample of the validation set counted once at any world size.
    enabled: bool = True
    # Also at the end of training; 0: only at the end.
    every_steps: int = Field(0, ge=0)
    # imagefolder and mlm_shards: the validation set, in data.kind's layout. Default: val/ beside
    # data.path when that folder is named train (the layout prepare-imagenet leaves).
    path: str | None = None
    # synthetic: held-out samples (ids after the training ones). Default: as many per training
    # sample as ImageNet has (50,000 for the default data.synthetic_samples), at least 1.
    synthetic_samples: int | None = Field(None, gt=0)
    # Samples per device and forward pass. Default: train.micro_batch_size.
    batch_size: int | None = Field(None, gt=0)


class TrainConfig(StrictModel):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    optim: OptimSection = OptimSection()
    train: TrainSection = TrainSection()
    checkpoint: CheckpointSection = CheckpointSection()
    distributed: DistributedSection = DistributedSection()
    metrics: MetricsSection = MetricsSection()
    eval: EvalSection = EvalSection()

    @model_validator(mode="after")
    def _data_fits_model(self):
        if self.model.is_masked_lm and self.data.kind == "imagefolder":
            raise FieldProblem("data.kind", self.data.kind, f"synthetic or mlm_shards for {self.model.name}")
        if self.model.name in IMAGE_MODELS and self.data.kind == "mlm_shards":
            raise FieldProblem("data.kind", self.data.kind, f"synthetic or imagefolder for {self.model.name}")
        if self.train.precision == "fp16" and self.train.device == "cpu":
            raise FieldProblem("train.precision", "fp16", "auto, fp32 or bf16 on cpu (fp16 needs a GPU)")
        return self

    @property
    def label_smoothing(self) -> float:
        """``train.label_smoothing``, or the model's recipe when it is not set."""
        if self.train.label_smoothing is not None:
            return self.train.label_smoothing
        return 0.0 if self.model.is_masked_lm else IMAGE_LABEL_SMOOTHING


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--optim.lr=0.2", "--train.epochs", "3"]`` as a nested mapping; values are YAML scalars."""
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError("command line", [f"got {show(arg)}; allowed: --section.key=value overrides"])
        key, sep, value = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args):
                raise ConfigError("command line", [f"{key}: a value is missing; allowed: --{key}=VALUE"])
            i += 1
            value = args[i]
        node = overrides
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError("command line", [f"{key}: {part} is set twice"])
        node[leaf] = _yaml_value(key, value) if value else None
        i += 1
    return overrides


def _yaml_value(key: str, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "not YAML"
        raise ConfigError("command line", [f"{key}: got {show(text)}, which does not parse ({problem}); allowed: a "
                                           "number, true/false, a string, or a list such as [0.9, 0.999]"]) from None


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_train_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """The config file (or the defaults) with overrides applied. Raises ConfigError."""
    data = read_yaml_mapping(path, "pass an existing YAML file with --config") if path else {}
    source = str(path) if path else "defaults"
    if overrides:
        data = _merge(data, parse_overrides(list(overrides)))
        source += " + command line"
    return validate(TrainConfig, data, source)


def check_overrides(overrides: list[str], partial: bool = False) -> list[str]:
    """The problems of ``--section.key=value`` overrides, one line each (empty when they are fine).

    ``partial``: a config file the caller cannot read comes with them, so only the keys given here
    are judged, each by its own type and bounds and by the rules of its section; a rule that
    spans sections (model against data kind) may be met by the file and is left to the trainer.
    """
    try:
        data = parse_overrides(overrides)
    except ConfigError as exc:
        return exc.problems
    try:
        TrainConfig.model_validate(data)
    except ValidationError as exc:
        given = {".".join(path) for path in _leaf_paths(data)}

        def judged(path: str, loc: tuple) -> bool:
            return loc != () and any(key == path or key.startswith(path + ".") for key in given)

        return format_errors(exc, TrainConfig, {}, judged if partial else None)
    return []


def _leaf_paths(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for key, value in data.items():
        path = (*prefix, str(key))
        paths += _leaf_paths(value, path) if isinstance(value, dict) and value else [path]
    return paths


def describe_keys() -> list[str]:
    """Every config key as ``--section.key=DEFAULT``, with its choices: for ``train --help``."""
    lines = []
    for section_name, section in TrainConfig.model_fields.items():
        for key, field in section.annotation.model_fields.items():
            default = yaml.safe_dump(field.default, default_flow_style=True).strip().removesuffix("...").strip()
            choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is Literal else ()
            if (section_name, key) == ("model", "name"):
                choices = MODEL_NAMES
            hint = f"  ({' | '.join(choices)})" if choices else ""
            lines.append(f"  --{section_name}.{key}={default}{hint}")
    return lines
