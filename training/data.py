"""Datasets keyed by :class:`~training.sampler.SampleKey`, and the loader that reads them.

Every random choice a sample needs (crop, flip, which tokens to mask) comes from the key's
seed, so a sample looks the same whichever rank reads it, before or after a restart.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from training.config import TrainConfig
from training.sampler import MicroBatchSampler, SampleKey

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png"}
IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
# BERT's uncased WordPiece vocabulary: [PAD]=0, [CLS]=101, [SEP]=102, [MASK]=103.
PAD_ID, CLS_ID, SEP_ID, MASK_ID = 0, 101, 102, 103
IGNORE_LABEL = -100


class DataError(Exception):
    """A dataset that cannot be read as configured; the message says what was found and what is expected."""


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- image transforms, in torch ---------------------------------------------------------------


def random_resized_crop(image: Tensor, size: int, generator: torch.Generator,
                        scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> Tensor:
    """Inception-style crop: a random area and aspect ratio, resized to ``size`` x ``size``."""
    _, height, width = image.shape
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * float(torch.empty(1).uniform_(*scale, generator=generator))
        aspect = math.exp(float(torch.empty(1).uniform_(*log_ratio, generator=generator)))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
            left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
            return _resize(image[:, top : top + h, left : left + w], (size, size))
    return center_crop(_resize_shorter(image, size), size)  # extreme aspect ratio: fall back


def center_crop(image: Tensor, size: int) -> Tensor:
    _, height, width = image.shape
    top, left = (height - size) // 2, (width - size) // 2
    return image[:, top : top + size, left : left + size]


def _resize(image: Tensor, hw: tuple[int, int]) -> Tensor:
    return F.interpolate(image[None], size=hw, mode="bilinear", antialias=True, align_corners=False)[0]


def _resize_shorter(image: Tensor, size: int) -> Tensor:
    _, height, width = image.shape
    scale = size / min(height, width)
    return _resize(image, (max(size, round(height * scale)), max(size, round(width * scale))))


def train_transform(image: Tensor, size: int, seed: int) -> Tensor:
    generator = _generator(seed)
    image = random_resized_crop(image, size, generator)
    if torch.rand(1, generator=generator) < 0.5:
        image = image.flip(-1)
    return normalize(image)


def eval_transform(image: Tensor, size: int) -> Tensor:
    """Resize the shorter side to size / 0.875 (256 for 224), then a centre crop."""
    return normalize(center_crop(_resize_shorter(image, round(size / 0.875)), size))


def normalize(image: Tensor) -> Tensor:
    return (image - IMAGENET_MEAN) / IMAGENET_STD


# --- datasets ---------------------------------------------------------------------------------


class ImageFolder(Dataset):
    """``root/<class>/<image>`` read with Pillow; classes sorted by name, as torchvision does."""

    def __init__(self, root: str | Path, image_size: int, train: bool = True):
        self.root = Path(root)
        if not self.root.is_dir():
            raise DataError(f"data.path: {self.root} is not a directory; expected <path>/<class>/<image>.jpg")
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.samples = [
            (path, label)
            for label, name in enumerate(self.classes)
            for path in sorted((self.root / name).iterdir())
            if path.suffix.lower() in IMAGE_SUFFIXES
        ]
        if not self.samples:
            raise DataError(f"data.path: no .jpg/.jpeg/.png images in class folders under {self.root}")
        self.image_size, self.train = image_size, train

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> Tensor:
        from PIL import Image

        with Image.open(self.samples[index][0]) as img:
            array = np.asarray(img.convert("RGB"), dtype=np.uint8)
        return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(255)

    def __getitem__(self, key: SampleKey) -> tuple[Tensor, int]:
        image = self.load(key.index)
        if self.train:
            return train_transform(image, self.image_size, key.seed), self.samples[key.index][1]
        return eval_transform(image, self.image_size), self.samples[key.index][1]


class SyntheticImages(Dataset):
    """Deterministic images per sample id: a class prototype plus noise, so a model can learn them."""

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int = 0):
        self.size, self.num_classes, self.image_size = size, num_classes, image_size
        self.prototypes = torch.randn(num_classes, 3, image_size, image_size, generator=_generator(seed + 7))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: SampleKey) -> tuple[Tensor, int]:
        generator = _generator(key.index * 7919 + 1)
        label = int(torch.randint(0, self.num_classes, (1,), generator=generator))
        noise = torch.randn(3, self.image_size, self.image_size, generator=generator)
        return self.prototypes[label] + 2.0 * noise, label


class MaskedLMShards(Dataset):
    """Pre-tokenized sequences in ``*.npy`` shards (shape [n, seq_len], integer token ids), memory-mapped.

    Masking is dynamic: each epoch masks other tokens, chosen from the key's seed.
    """

    def __init__(self, root: str | Path, seq_len: int, vocab_size: int, mask_probability: float):
        root = Path(root)
        paths = sorted(root.glob("*.npy")) if root.is_dir() else []
        if not paths:
            raise DataError(f"data.path: no *.npy token shards in {root}; expected arrays of shape [n, {seq_len}]")
        self.shards = [np.load(p, mmap_mode="r") for p in paths]
        for path, shard in zip(paths, self.shards):
            if shard.ndim != 2 or shard.shape[1] != seq_len or shard.dtype.kind not in "iu":
                raise DataError(
                    f"{path}: got shape {list(shard.shape)} of {shard.dtype}; expected integer token ids "
                    f"of shape [n, {seq_len}] (data.seq_len)"
                )
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])
        self.vocab_size, self.mask_probability = vocab_size, mask_probability

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def tokens(self, index: int) -> Tensor:
        shard = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return torch.from_numpy(np.asarray(self.shards[shard][index - self.offsets[shard]], dtype=np.int64))

    def __getitem__(self, key: SampleKey) -> tuple[Tensor, Tensor]:
        return mask_tokens(self.tokens(key.index), key.seed, self.vocab_size, self.mask_probability)


class SyntheticTokens(MaskedLMShards):
    """Deterministic token sequences per sample id, for benchmarks."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, mask_probability: float):
        self.size, self.seq_len = size, seq_len
        self.vocab_size, self.mask_probability = vocab_size, mask_probability

    def __len__(self) -> int:
        return self.size

    def tokens(self, index: int) -> Tensor:
        body = torch.randint(1000, self.vocab_size, (self.seq_len - 2,), generator=_generator(index + 1))
        return torch.cat([torch.tensor([CLS_ID]), body, torch.tensor([SEP_ID])])


def mask_tokens(tokens: Tensor, seed: int, vocab_size: int, probability: float) -> tuple[Tensor, Tensor]:
    """BERT's masking: of the chosen positions, 80 % become [MASK], 10 % a random token, 10 % stay."""
    generator = _generator(seed)
    special = (tokens == PAD_ID) | (tokens == CLS_ID) | (tokens == SEP_ID)
    chosen = (torch.rand(tokens.shape, generator=generator) < probability) & ~special
    labels = torch.where(chosen, tokens, IGNORE_LABEL)
    roll = torch.rand(tokens.shape, generator=generator)
    inputs = torch.where(chosen & (roll < 0.8), MASK_ID, tokens)
    random_tokens = torch.randint(0, vocab_size, tokens.shape, generator=generator)
    inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_tokens, inputs)
    return inputs, labels


class Keyed(Dataset):
    """Adds each key's index and loss weight to the sample, for the weighted loss and sample logs."""

    def __init__(self, inner: Dataset):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, key: SampleKey) -> tuple[Any, Any, int, float]:
        inputs, target = self.inner[key]
        return inputs, target, key.index, key.weight


def build_dataset(config: TrainConfig, vocab_size: int | None = None) -> Dataset:
    data, model = config.data, config.model
    if data.kind == "imagefolder":
        return ImageFolder(data.path, model.image_size)
    if data.kind == "mlm_shards":
        return MaskedLMShards(data.path, data.seq_len, vocab_size, data.mask_probability)
    if model.is_masked_lm:
        return SyntheticTokens(data.synthetic_samples, data.seq_len, vocab_size, data.mask_probability)
    return SyntheticImages(data.synthetic_samples, model.num_classes, model.image_size, config.train.seed)


def build_loader(dataset: Dataset, sampler: MicroBatchSampler, config: TrainConfig, pin_memory: bool) -> DataLoader:
    workers = config.data.num_workers
    return DataLoader(
        Keyed(dataset),
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        prefetch_factor=config.data.prefetch_factor if workers else None,
        persistent_workers=False,
    )
