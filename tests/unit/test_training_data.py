"""Datasets and transforms: Pillow-decoded ImageFolder, torch transforms, masked-LM shards, synthetic data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from training.config import TrainConfig
from training.data import datasets
from training.data.datasets import (
    CLS_ID, MASK_ID, PAD_ID, SEP_ID, DataError, ImageFolder, MaskedLMShards, Paced, SyntheticImages, attention_mask,
    build_dataset, mask_tokens,
)
from training.data.sampler import SampleKey


@pytest.fixture
def image_folder(tmp_path):
    rng = np.random.default_rng(0)
    for name, suffix in (("n01", ".JPEG"), ("n02", ".png")):
        (tmp_path / name).mkdir()
        for i in range(3):
            pixels = rng.integers(0, 255, (40 + i, 60, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / name / f"img{i}{suffix}")
    (tmp_path / "n02" / "notes.txt").write_text("ignored")
    return tmp_path


def test_image_folder_reads_jpeg_and_png_into_normalized_crops(image_folder):
    dataset = ImageFolder(image_folder, image_size=32)
    assert dataset.classes == ["n01", "n02"] and len(dataset) == 6
    image, label = dataset[SampleKey(4, 1.0, seed=11)]
    assert image.shape == (32, 32, 3) and image.dtype == torch.uint8 and label == 1  # HWC, 1/4 of float32
    again, _ = dataset[SampleKey(4, 1.0, seed=11)]
    other, _ = dataset[SampleKey(4, 1.0, seed=12)]
    assert torch.equal(image, again) and not torch.equal(image, other)  # augmentation follows the seed


def test_the_device_normalizes_uint8_nhwc_batches_into_channels_last_floats():
    from training.data.transforms import IMAGENET_MEAN, IMAGENET_STD
    from training.data.feed import move
    from training.device import detect

    images = torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8)
    expected = (images.permute(0, 3, 1, 2).float() / 255 - IMAGENET_MEAN) / IMAGENET_STD
    moved = move(images, detect("cpu"), channels_last=True)
    assert moved.dtype == torch.float32 and moved.shape == (2, 3, 8, 8)
    assert moved.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(moved, expected, atol=1e-5)
    assert move(images, detect("cpu"), channels_last=False).is_contiguous()
    floats = torch.randn(2, 3, 8, 8)  # synthetic images stay as they are
    assert torch.equal(move(floats, detect("cpu"), channels_last=False), floats)


@pytest.mark.parametrize("layout", ["missing", "empty"])
def test_an_unreadable_image_folder_is_one_clear_error(tmp_path, layout):
    root = tmp_path / "data"
    if layout == "empty":
        (root / "n01").mkdir(parents=True)
    with pytest.raises(DataError, match="data.path"):
        ImageFolder(root, 32)


def test_masked_lm_shards_are_memory_mapped_and_masked_dynamically(tmp_path):
    tokens = np.random.default_rng(0).integers(1000, 30000, (50, 64), dtype=np.int32)
    tokens[:, 0], tokens[:, -1] = CLS_ID, SEP_ID
    np.save(tmp_path / "shard-000.npy", tokens[:30])
    np.save(tmp_path / "shard-001.npy", tokens[30:])
    dataset = MaskedLMShards(tmp_path, seq_len=64, vocab_size=30522, mask_probability=0.15)
    assert len(dataset) == 50
    assert torch.equal(dataset.tokens(42), torch.from_numpy(tokens[42].astype(np.int64)))
    inputs, labels = dataset[SampleKey(42, 1.0, seed=1)]
    inputs_next_epoch, _ = dataset[SampleKey(42, 1.0, seed=2)]
    assert not torch.equal(inputs, inputs_next_epoch)
    assert labels[0] == -100 and labels[-1] == -100  # [CLS] and [SEP] are never masked


def test_masking_follows_bert_proportions():
    tokens = torch.randint(1000, 30000, (200_000,))
    inputs, labels = mask_tokens(tokens, seed=0, vocab_size=30522, probability=0.15)
    chosen = labels != -100
    assert chosen.float().mean() == pytest.approx(0.15, abs=0.005)
    assert (inputs[chosen] == MASK_ID).float().mean() == pytest.approx(0.8, abs=0.01)
    assert (inputs[chosen] == tokens[chosen]).float().mean() == pytest.approx(0.1, abs=0.01)
    assert torch.equal(inputs[~chosen], tokens[~chosen])


def test_every_sequence_has_the_same_number_of_masked_positions_as_the_mlm_head_gathers():
    from training.config import masked_per_sequence

    counts = set()
    for seed in range(50):
        tokens = torch.randint(1000, 30000, (128,), generator=torch.Generator().manual_seed(seed))
        tokens[0], tokens[-1] = CLS_ID, SEP_ID
        _, labels = mask_tokens(tokens, seed=seed, vocab_size=30522, probability=0.15)
        counts.add(int((labels != -100).sum()))
        assert labels[0] == -100 and labels[-1] == -100
    assert counts == {masked_per_sequence(128, 0.15)} == {19}  # round(128 * 0.15), as BERT's num_to_predict



@pytest.mark.parametrize("real, masked", [(62, 9), (12, 2), (3, 1), (0, 0)])
def test_a_padded_sequence_is_masked_in_proportion_to_its_own_tokens(real, masked):
    """google-research/bert counts num_to_predict on the unpadded tokens, [CLS] and [SEP] included:
    a short row keeps its context (this masked all 12 tokens of a 12-token row, when it counted
    the row's padded length)."""
    row = torch.full((128,), PAD_ID)
    row[:real] = torch.arange(1000, 1000 + real)
    if real:
        row[0], row[real - 1] = CLS_ID, SEP_ID
    _, labels = mask_tokens(row, seed=0, vocab_size=30522, probability=0.15)
    chosen = labels != -100
    assert int(chosen.sum()) == masked  # round(real * 0.15), at least 1 while there is a token to mask
    assert not chosen[real:].any() and (not real or not chosen[[0, real - 1]].any())


def test_the_attention_mask_covers_padding_only_when_a_batch_has_some():
    full = torch.randint(1000, 30000, (3, 16))
    assert attention_mask(full, torch.full_like(full, -100)) is None  # no padding: no mask, the fastest kernel
    padded = full.clone()
    padded[0, 10:] = PAD_ID
    padded[1, :] = PAD_ID  # a bad sample's placeholder: nothing to attend to
    labels = torch.full_like(padded, -100)
    padded[2, 4], labels[2, 4] = PAD_ID, 2000  # a masked token whose random replacement is [PAD]'s id
    mask = attention_mask(padded, labels)
    assert mask.dtype == torch.bool and mask.shape == (3, 16)
    assert mask[0, :10].all() and not mask[0, 10:].any()
    assert mask[1].all()  # attending to nothing would make the row NaN, and 0 x NaN is NaN
    assert mask[2].all()


def test_shards_of_the_wrong_shape_are_rejected(tmp_path):
    np.save(tmp_path / "bad.npy", np.zeros((4, 32), dtype=np.int32))
    with pytest.raises(DataError, match=r"expected integer token ids of shape \[n, 64\]"):
        MaskedLMShards(tmp_path, seq_len=64, vocab_size=100, mask_probability=0.15)


def test_synthetic_images_depend_only_on_the_sample_id():
    a, b = SyntheticImages(100, 10, 16), SyntheticImages(100, 10, 16)
    x1, y1 = a[SampleKey(7, 1.0, 1)]
    x2, y2 = b[SampleKey(7, 0.0, 99)]
    assert torch.equal(x1, x2) and y1 == y2


def test_the_trainer_keeps_attention_off_the_padding_of_its_shards(tmp_path, monkeypatch):
    from training.config import load_train_config
    from training.models.bert import BertForMaskedLM
    from training.loop.trainer import Trainer

    rows = np.random.default_rng(0).integers(1000, 30000, size=(8, 16))
    rows[:4, 10:] = PAD_ID  # half the rows are short, as reference BERT makes 10 % of them
    (tmp_path / "shards").mkdir()
    np.save(tmp_path / "shards" / "000.npy", rows.astype(np.int32))
    seen = []
    forward = BertForMaskedLM.forward

    def recording(self, tokens, attention_mask=None, labels=None, **kwargs):
        if tokens.device.type != "meta":  # not the FLOPs count
            seen.append((tokens.clone(), labels.clone(), attention_mask))
        return forward(self, tokens, attention_mask, labels, **kwargs)

    monkeypatch.setattr(BertForMaskedLM, "forward", recording)
    Trainer(load_train_config(None, [
        "--data.kind=mlm_shards", f"--data.path={tmp_path / 'shards'}", "--data.seq_len=16", "--data.num_workers=0",
        "--model.name=bert_tiny", "--train.global_batch_size=4", "--train.micro_batch_size=2",
        "--train.max_steps=4", "--train.precision=fp32", "--train.device=cpu",
        f"--checkpoint.dir={tmp_path}/ckpt", f"--metrics.jsonl_path={tmp_path}/m.jsonl",
    ])).run()
    assert len(seen) == 8
    for tokens, labels, mask in seen:
        padding = (tokens == PAD_ID) & (labels == -100)
        assert (mask is None) == (not padding.any())  # unpadded micro-batches keep the unmasked kernel
        if mask is not None:
            assert torch.equal(~mask, padding)
    assert sum(mask is not None for _, _, mask in seen) >= 2  # 4 of the 8 rows are padded: 2 micro-batches at least


class FakeClock:
    """time.monotonic and time.sleep of datasets.py on a clock the test moves: the pace's waits, exactly."""

    def __init__(self):
        self.now, self.slept = 100.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_paced_synthetic_data_keeps_to_its_rate_with_a_bounded_read_ahead(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(datasets, "time", clock)
    # 128 samples/s: slots of 1/128 s, exact in binary like the clock's times, so the waits compare exactly.
    config = TrainConfig.model_validate({"model": {"name": "mlp", "image_size": 16, "num_classes": 4},
                                         "data": {"synthetic_samples": 64, "synthetic_samples_per_s": 128}})
    paced = build_dataset(config)
    assert isinstance(paced, Paced) and len(paced) == 64
    plain = SyntheticImages(64, 4, 16)
    slot = 1 / 128
    at_once = round(Paced.CATCH_UP_S * 128) + 1  # the read-ahead buffer after a pause, and the read due now

    def read(count: int) -> None:
        for i in range(count):
            image, _ = paced[SampleKey(i, 1.0, seed=0)]
            assert torch.equal(image, plain[SampleKey(i, 1.0, seed=0)][0])  # the same samples, only later

    read(at_once + 2)  # the buffer at once, then one sample a slot
    assert clock.slept == [slot, slot]
    clock.now += slot / 2  # a step's compute: half of the next slot has passed
    read(1)
    assert clock.slept[-1] == slot / 2
    clock.now += 5.0  # a checkpoint: no more than the buffer comes at once after it
    clock.slept.clear()
    read(at_once + 1)
    assert clock.slept == [slot]
    assert paced.placeholder()[0].shape == (16, 16, 3)


def test_unpaced_synthetic_data_is_the_dataset_itself():
    config = TrainConfig.model_validate({"model": {"name": "mlp", "image_size": 16, "num_classes": 4},
                                         "data": {"synthetic_samples": 64}})
    assert type(build_dataset(config)) is SyntheticImages
