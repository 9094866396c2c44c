"""The trainer's config: a file plus dotted overrides; every mistake is one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from tests.conftest import REPO
from training.config import TrainConfig, load_train_config, parse_overrides
from typed_config import ConfigError


def problems(tmp_path, text: str | None = None, overrides: list[str] = ()) -> list[str]:
    path = None
    if text is not None:
        path = tmp_path / "job.yaml"
        path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_train_config(path, overrides)
    return caught.value.problems


def test_defaults_are_a_resnet50_run_in_the_devices_precision_with_checkpoints_on_fsx():
    config = load_train_config(None)
    assert (config.model.name, config.train.precision, config.train.global_batch_size) == ("resnet50", "auto", 256)
    assert config.checkpoint.dir.startswith("/fsx/")


def test_overrides_win_over_the_file_and_are_typed(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("optim:\n  lr: 0.4\n  name: sgd\ntrain:\n  epochs: 5\n")
    config = load_train_config(path, ["--optim.lr=0.2", "--train.max_steps", "100", "--model.compile=true"])
    assert (config.optim.lr, config.optim.name, config.train.epochs) == (0.2, "sgd", 5)
    assert config.train.max_steps == 100 and config.model.compile is True


def test_override_syntax():
    assert parse_overrides(["--a.b=1", "--a.c", "x", "--d=[1, 2]"]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2]}


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        (None, ["--optim.learning_rate=0.1"],
         "optim.learning_rate: unknown key; allowed keys here: betas, decay_norms_and_biases, "
         "grad_clip_norm, lr, momentum, name, schedule, warmup_steps, weight_decay"),
        (None, ["--trian.epochs=3"], "trian: unknown key; allowed keys here: checkpoint, data, distributed, "
                                     "eval, metrics, model, optim, train"),
        (None, ["--train.precision=fp8"], "train.precision: got \"fp8\"; allowed: 'auto', 'fp32', 'bf16' or 'fp16'"),
        (None, ["--model.name=resnet51"], "model.name: got \"resnet51\"; allowed: resnet18, resnet34, resnet50"),
        (None, ["--train.global_batch_size=0"], "train.global_batch_size: got 0; allowed: greater than 0"),
        (None, ["--data.kind=imagefolder"], "data.path: got null; allowed: a directory on the shared file system"),
        (None, ["--model.name=bert_large", "--data.kind=imagefolder", "--data.path=/fsx/x"],
         "data.kind: got \"imagefolder\"; allowed: synthetic or mlm_shards for bert_large"),
        (None, ["--train.device=cpu", "--train.precision=fp16"],
         "train.precision: got \"fp16\"; allowed: auto, fp32 or bf16 on cpu"),
        ("train: [1]\n", [], "train: got [1]; allowed: a valid dictionary or instance of TrainSection"),
        ("train:\n  epochs: 2\n  epochs: 3\n", [], "line 3, column 3: invalid YAML: duplicate key 'epochs'"),
        (None, ["--train.epochs"], "train.epochs: a value is missing; allowed: --train.epochs=VALUE"),
        (None, ["epochs=3"], "got \"epochs=3\"; allowed: --section.key=value overrides"),
        (None, ["--optim.lr=.inf"], "optim.lr: got Infinity; allowed: a finite number"),
        (None, ["--optim.lr=.nan"], "optim.lr: got NaN; allowed: a finite number"),
        (None, ["--optim.grad_clip_norm=.inf"], "optim.grad_clip_norm: got Infinity; allowed: a finite number"),
        (None, ["--checkpoint.if_unusable=wipe"],
         "checkpoint.if_unusable: got \"wipe\"; allowed: 'fail' or 'start_fresh'"),
        (None, ["--data.max_bad_samples=-1"], "data.max_bad_samples: got -1; allowed: greater than or equal to 0"),
        (None, ["--data.kind=imagefolder", "--data.path=/fsx/x", "--data.synthetic_samples_per_s=800"],
         "data.synthetic_samples_per_s: got 800.0; allowed: unset for kind imagefolder"),
        (None, ["--data.synthetic_samples_per_s=0"], "data.synthetic_samples_per_s: got 0; allowed: greater than 0"),
        # A value that is not YAML used to end in PyYAML's multi-line parser traceback.
        (None, ["--optim.betas=[0.9"], "optim.betas: got \"[0.9\", which does not parse (expected ',' or ']', but got "
                                      "'<stream end>'); allowed: a number, true/false, a string, or a list such as "
                                      "[0.9, 0.999]"),
    ],
)
def test_each_mistake_is_one_line_naming_the_field(tmp_path, text, overrides, expected):
    found = problems(tmp_path, text, overrides)
    assert len(found) == 1
    assert found[0].startswith(expected), found[0]


def test_the_cli_prints_one_line_and_exits_2_without_a_traceback():
    result = subprocess.run([sys.executable, "-m", "training", "train", "--optim.lr=-1"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "config error: defaults + command line: optim.lr: got -1; allowed: greater than 0"
    )


@pytest.mark.parametrize("args, expected", [
    (["bench", "--steps", "0"], "error: python -m training bench: argument --steps: got '0'; allowed: a whole number of "
                                "at least 1; see `python -m training bench --help`"),
    (["bench", "--warmup-steps=x"], "error: python -m training bench: argument --warmup-steps: got 'x'; allowed: a whole "
                                    "number of at least 0; see `python -m training bench --help`"),
    (["allreduce-bench", "--iterations", "-2"], "error: python -m training allreduce-bench: argument --iterations: got "
                                                "'-2'; allowed: a whole number of at least 1; see `python -m training "
                                                "allreduce-bench --help`"),
])
def test_a_bad_count_on_the_command_line_is_one_line(args, expected):
    # bench --steps 0 used to end in an UnboundLocalError from the timing loop.
    result = subprocess.run([sys.executable, "-m", "training", *args], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert (result.returncode, result.stderr.strip()) == (2, expected)


def test_a_missing_config_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_train_config(tmp_path / "missing.yaml")
    assert caught.value.problems == ["cannot read the file (No such file or directory); pass an existing YAML file "
                                     "with --config"]


def test_config_is_frozen():
    with pytest.raises(ValidationError, match="frozen"):
        TrainConfig().train.epochs = 3  # type: ignore[misc]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_asking_for_a_missing_device_is_one_line():
    result = subprocess.run([sys.executable, "-m", "training", "train", "--train.device=cuda"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        'error: train.device: got "cuda" but torch sees no CUDA device; allowed here: auto, cpu'
    )
