"""Validation's parts: top-1/top-5 and masked-LM accuracy counted right, a validation set dealt
out without padding, where it is found, and torchvision's evaluation view. The runs (two
processes, the trainer) are in tests/drills/test_evaluation_runs.py."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.reference_libraries import needs_torchvision
from training.config import load_train_config
from training.data.datasets import DataError, build_dataset
from training.data.sampler import SampleKey
from training.data.transforms import eval_resize_size, resize_center_crop_pillow
from training.data.validation import build_validation_dataset, rank_batches
from training.loop.evaluate import classification_sums, masked_lm_sums
from training.models import build_model

pytestmark = pytest.mark.timeout(240)


def tiny_config(tmp_path, model: str, *extra: str):
    shape = ["--model.image_size=16", "--model.num_classes=5"] if model != "bert_tiny" else ["--data.seq_len=32"]
    return load_train_config(None, [
        f"--model.name={model}", *shape, "--data.synthetic_samples=100", "--data.num_workers=0",
        "--eval.synthetic_samples=21", "--eval.batch_size=4", "--train.precision=fp32", "--train.device=cpu",
        f"--checkpoint.dir={tmp_path}/checkpoints", *extra,
    ])


# --- the figures of one batch -------------------------------------------------------------------


def test_top1_and_top5_of_a_hand_checked_batch():
    logits = torch.tensor([
        [0.0, 1.0, 9.0, 2.0, 3.0, 4.0, 5.0],  # target 2: the highest, a hit at 1 and at 5
        [3.0, 9.0, 8.0, 0.0, 1.0, 2.0, 7.0],  # target 0: fourth (9, 8, 7, 3), a hit at 5 only
        [6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0],  # target 6: the lowest, no hit
        [1.0, 9.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # target 1 but weight 0 (an unreadable sample): not counted
        [5.0, 4.0, 3.0, 2.0, 1.0, 0.0, 6.0],  # target 4: sixth (6, 5, 4, 3, 2, 1), just outside the five
    ])
    target = torch.tensor([2, 0, 6, 1, 4])
    valid = torch.tensor([True, True, True, False, True])
    samples, units, loss, top1, top5 = classification_sums(logits, target, valid).tolist()
    assert (samples, units, top1, top5) == (4, 4, 1, 2)

    def cross_entropy(row: list[float], label: int) -> float:
        return math.log(sum(math.exp(v) for v in row)) - row[label]

    expected = sum(cross_entropy(logits[i].tolist(), int(target[i])) for i in (0, 1, 2, 4))
    assert loss == pytest.approx(expected, rel=1e-6)


def test_with_fewer_than_five_classes_top5_counts_every_sample():
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    assert classification_sums(logits, torch.tensor([0, 2]), torch.tensor([True, True])).tolist()[3:] == [0, 2]


def test_masked_lm_figures_are_the_models_own_loss_and_its_argmax(tmp_path):
    config = tiny_config(tmp_path, "bert_tiny")
    torch.manual_seed(0)
    model = build_model("bert_tiny").eval()
    dataset = build_validation_dataset(config, model.size.vocab, None)
    keys = rank_batches(len(dataset), 4, 0, 1)[0][1]
    tokens, labels = (torch.stack(column) for column in zip(*(dataset[key] for key in keys), strict=True))
    with torch.no_grad():
        sums = masked_lm_sums(model, tokens, labels, None, torch.ones(4, dtype=torch.bool),
                              config.data.masked_per_sequence)
        mean_loss = model(tokens, labels=labels)
        logits = model(tokens)
    masked = labels != -100
    samples, tokens_counted, loss, right, _ = sums.tolist()
    assert (samples, tokens_counted) == (4, int(masked.sum()))
    assert loss / tokens_counted == pytest.approx(float(mean_loss), rel=1e-5)
    assert right == int((logits.argmax(-1)[masked] == labels[masked]).sum())


# --- the validation set -------------------------------------------------------------------------


def test_batches_are_dealt_out_without_padding_so_each_sample_is_evaluated_once():
    for world in (1, 2, 3, 8, 30):
        shares = [rank_batches(21, 4, rank, world) for rank in range(world)]
        numbers = sorted(number for share in shares for number, _ in share)
        indices = sorted(key.index for share in shares for _, keys in share for key in keys)
        assert numbers == list(range(6)) and indices == list(range(21)), world
    assert [len(keys) for _, keys in rank_batches(21, 4, 1, 2)] == [4, 4, 1]  # batches 1, 3, 5


def test_the_synthetic_held_out_split_is_not_the_training_set(tmp_path):
    config = tiny_config(tmp_path, "resnet18")
    train_set = build_dataset(config)
    held_out = build_validation_dataset(config, None, train_set)
    assert len(held_out) == 21
    key = SampleKey(0, 1.0, 0)
    assert not torch.equal(held_out[key][0], train_set[key][0])
    assert torch.equal(held_out[key][0], train_set.__class__(10**6, 5, 16, 0)[SampleKey(100, 1.0, 0)][0])
    default = load_train_config(None, [])
    assert build_validation_dataset(default, None, None).size == 50_000  # ImageNet's, for ImageNet's train size


def write_images(root: Path, classes: list[str], per_class: int = 2) -> None:
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (30 + 4 * i, 24), (50 * c, 20 * i, 90)).save(root / name / f"{i}.jpg")


def test_an_imagefolder_val_beside_train_keeps_the_training_labels(tmp_path):
    write_images(tmp_path / "train", ["a", "b", "c"])
    write_images(tmp_path / "val", ["b", "c"])
    config = load_train_config(None, ["--data.kind=imagefolder", f"--data.path={tmp_path}/train",
                                      "--model.image_size=16", "--model.num_classes=3"])
    val = build_validation_dataset(config, None, build_dataset(config))
    assert [label for _, label in val.samples] == [1, 1, 2, 2]
    image, label = val[SampleKey(2, 1.0, 123)]
    assert image.shape == (16, 16, 3) and label == 2
    assert torch.equal(image, val[SampleKey(2, 1.0, 456)][0])  # no augmentation: the seed does nothing


def test_a_missing_or_mismatched_validation_set_is_one_line_naming_eval_path(tmp_path, caplog):
    write_images(tmp_path / "train", ["a", "b"])
    args = ["--data.kind=imagefolder", f"--data.path={tmp_path}/train", "--model.image_size=16",
            "--model.num_classes=3"]
    with pytest.raises(DataError) as missing:
        build_validation_dataset(load_train_config(None, args), None, None)
    assert str(missing.value) == (
        f"eval.path: {tmp_path}/val (val/ beside data.path) is not a directory; allowed: the validation set in "
        "imagefolder's layout (prepare-imagenet makes ImageNet's), or eval.enabled=false")
    write_images(tmp_path / "other", ["a", "z"])
    config = load_train_config(None, [*args, f"--eval.path={tmp_path}/other"])
    with pytest.raises(DataError, match=r"^eval.path: class folder z in .* is not one of the training set's 2 "):
        build_validation_dataset(config, None, build_dataset(config))
    assert build_validation_dataset(load_train_config(None, [*args, "--eval.enabled=false"]), None, None) is None
    # A data.path not named train: no val/ to guess, so no evaluation, and the log says so.
    elsewhere = load_train_config(None, [*args[:1], f"--data.path={tmp_path}/other", *args[2:]])
    assert build_validation_dataset(elsewhere, None, None) is None
    assert "evaluation is off: eval.path is not set" in caplog.text


def test_mlm_shards_validate_on_val_beside_train_masked_the_same_way_every_time(tmp_path):
    rng = np.random.default_rng(0)
    for split, rows in (("train", 12), ("val", 5)):
        (tmp_path / split).mkdir()
        np.save(tmp_path / split / "000.npy", rng.integers(1000, 30000, size=(rows, 16)).astype(np.int32))
    config = load_train_config(None, ["--model.name=bert_tiny", "--data.kind=mlm_shards",
                                      f"--data.path={tmp_path}/train", "--data.seq_len=16"])
    val = build_validation_dataset(config, 30522, None)
    assert len(val) == 5
    keys = [key for _, batch in rank_batches(5, 2, 0, 1) for key in batch]
    first = [val[key] for key in keys]
    again = build_validation_dataset(config.model_copy(update={"train": config.train.model_copy(update={"seed": 7})}),
                                     30522, None)
    for (inputs, labels), (inputs_again, labels_again) in zip(first, (again[key] for key in keys), strict=True):
        assert torch.equal(inputs, inputs_again) and torch.equal(labels, labels_again)
        assert int((labels != -100).sum()) == 2  # round(0.15 * 16)


def gradient_image(width: int, height: int) -> Image.Image:
    x = np.linspace(0, 255, width)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height)[:, None].repeat(width, 1)
    return Image.fromarray(np.stack([x, y, np.full_like(x, 77)], -1).round().astype(np.uint8))


def test_the_eval_view_resizes_the_shorter_side_to_256_then_cuts_the_central_224():
    assert [eval_resize_size(s) for s in (224, 160, 299, 16)] == [256, 183, 342, 18]
    # 448 x 512 (w x h): the width becomes 256, the height int(256 * 512 / 448) = 292; the crop
    # starts round((292 - 224) / 2) = 34 rows and 16 columns in. On a linear gradient, the
    # bilinear resize keeps a pixel's value that of its centre's position in the original.
    out = resize_center_crop_pillow(gradient_image(448, 512), 224)
    assert out.shape == (224, 224, 3) and out.dtype == torch.uint8
    for row, column in ((0, 0), (111, 111), (223, 223), (50, 200)):
        source_x = (16 + column + 0.5) * 448 / 256 - 0.5
        source_y = (34 + row + 0.5) * 512 / 292 - 0.5
        assert abs(int(out[row, column, 0]) - source_x * 255 / 447) <= 1, (row, column)
        assert abs(int(out[row, column, 1]) - source_y * 255 / 511) <= 1, (row, column)
    assert resize_center_crop_pillow(gradient_image(40, 30).convert("L"), 16).shape == (16, 16, 3)


@needs_torchvision
def test_the_eval_view_is_torchvisions_evaluation_preset():
    from torchvision import transforms

    preset = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.PILToTensor()])
    for size in ((500, 375), (375, 500), (333, 333), (1023, 257)):
        image = gradient_image(*size)
        assert torch.equal(resize_center_crop_pillow(image, 224), preset(image).permute(1, 2, 0)), size


