"""Datasets keyed by :class:`~training.sampler.SampleKey`, and the loader that reads them.

Every random choice a sample needs (crop, flip, which tokens to mask) comes from the key's
seed, so a sample looks the same whichever rank reads it, before or after a restart.
"""

from __future__ import annotations

import logging
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
log = logging.getLogger(__name__)


class DataError(Exception):
    """A dataset that cannot be read as configured; the message says what was found and what is expected."""


class BadSample(Exception):
    """One sample that cannot be read (a corrupt image, a truncated shard): skipped, named and counted."""


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


# Images leave the loader as uint8 HWC: a quarter of float32's bytes to pin and copy, and the
# NHWC batch is already channels_last once permuted. The device converts and normalizes them
# (:func:`normalize_on_device`).


def train_transform(image: Tensor, size: int, seed: int) -> Tensor:
    """A decoded uint8 [3, H, W] image: random resized crop and flip, as uint8 [size, size, 3]."""
    generator = _generator(seed)
    image = random_resized_crop(image.float(), size, generator)
    if torch.rand(1, generator=generator) < 0.5:
        image = image.flip(-1)
    return _to_uint8_hwc(image)


def eval_transform(image: Tensor, size: int) -> Tensor:
    """Resize the shorter side to size / 0.875 (256 for 224), then a centre crop; uint8 HWC."""
    return _to_uint8_hwc(center_crop(_resize_shorter(image.float(), round(size / 0.875)), size))


def _to_uint8_hwc(image: Tensor) -> Tensor:
    return image.round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).contiguous()


def normalize_on_device(images: Tensor) -> Tensor:
    """uint8 [N, H, W, 3] (on the device) as normalized float [N, 3, H, W] in channels_last memory."""
    mean = (IMAGENET_MEAN * 255).to(images.device).view(1, 3, 1, 1)
    std = (IMAGENET_STD * 255).to(images.device).view(1, 3, 1, 1)
    return (images.permute(0, 3, 1, 2).float() - mean) / std


# --- datasets ---------------------------------------------------------------------------------


def decode_image(path: str | Path) -> Tensor:
    """An image file as a uint8 RGB tensor [3, H, W], decoded with Pillow."""
    from PIL import Image

    with Image.open(path) as img:
        array = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


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
        return decode_image(self.samples[index][0])

    def __getitem__(self, key: SampleKey) -> tuple[Tensor, int]:
        path, label = self.samples[key.index]
        try:
            image = self.load(key.index)
            if self.train:
                return train_transform(image, self.image_size, key.seed), label
            return eval_transform(image, self.image_size), label
        except Exception as exc:  # noqa: BLE001 - whatever Pillow raises for a bad file, the run goes on
            raise BadSample(f"{path}: {_reason(exc)}") from None

    def placeholder(self) -> tuple[Tensor, int]:
        """What stands in for a bad sample in its batch (with loss weight 0)."""
        return torch.zeros(self.image_size, self.image_size, 3, dtype=torch.uint8), 0


class SyntheticImages(Dataset):
    """Deterministic images per sample id: a class prototype plus noise, so a model can learn them."""

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int = 0):
        self.size, self.num_classes, self.image_size = size, num_classes, image_size
        self.prototypes = torch.randn(num_classes, 3, image_size, image_size, generator=_generator(seed + 7))

    def __len__(self) -> int:
        return self.size

    def placeholder(self) -> tuple[Tensor, int]:
        return torch.zeros(3, self.image_size, self.image_size), 0

    def __getitem__(self, key: SampleKey) -> tuple[Tensor, int]:
        generator = _generator(key.index * 7919 + 1)
        label = int(torch.randint(0, self.num_classes, (1,), generator=generator))
        noise = torch.randn(3, self.image_size, self.image_size, generator=generator)
        return self.prototypes[label] + 2.0 * noise, label


class MaskedLMShards(Dataset):
    """Pre-tokenized sequences in ``*.npy`` shards (shape [n, seq_len], integer token ids), memory-mapped.

    Masking is dynamic: each epoch masks other tokens, chosen from the key's seed. A shard cut
    short (an interrupted copy) keeps the rows its header promises: those past the end are bad
    samples, as are rows with token ids outside the vocabulary.
    """

    def __init__(self, root: str | Path, seq_len: int, vocab_size: int, mask_probability: float):
        root = Path(root)
        self.paths = sorted(root.glob("*.npy")) if root.is_dir() else []
        if not self.paths:
            raise DataError(f"data.path: no *.npy token shards in {root}; expected arrays of shape [n, {seq_len}]")
        self.seq_len = seq_len
        self.shards = [_open_shard(p, seq_len) for p in self.paths]
        self.offsets = np.cumsum([0] + [rows for _, rows in self.shards])
        self.vocab_size, self.mask_probability = vocab_size, mask_probability

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def tokens(self, index: int) -> Tensor:
        shard = int(np.searchsorted(self.offsets, index, side="right") - 1)
        array, _ = self.shards[shard]
        row = index - self.offsets[shard]
        if row >= len(array):
            raise BadSample(f"{self.paths[shard]}: row {row} is past the end of the file (the shard is truncated)")
        tokens = torch.from_numpy(np.asarray(array[row], dtype=np.int64))
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise BadSample(f"{self.paths[shard]}: row {row} has token ids outside 0..{self.vocab_size - 1}")
        return tokens

    def placeholder(self) -> tuple[Tensor, Tensor]:
        return torch.full((self.seq_len,), PAD_ID, dtype=torch.long), torch.full((self.seq_len,), IGNORE_LABEL)

    def __getitem__(self, key: SampleKey) -> tuple[Tensor, Tensor]:
        return mask_tokens(self.tokens(key.index), key.seed, self.vocab_size, self.mask_probability)


def _open_shard(path: Path, seq_len: int) -> tuple[np.ndarray, int]:
    """(readable rows, rows the header promises) of one shard; a header that cannot be read is a DataError."""
    try:
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read_header is None:
                raise ValueError(f"unsupported .npy format version {version}")
            shape, fortran, dtype = read_header(handle)
            header_bytes = handle.tell()
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable .npy file ({_reason(exc)}); allowed: integer token ids of shape "
                        f"[n, {seq_len}] (data.seq_len); remove or regenerate it") from None
    if len(shape) != 2 or shape[1] != seq_len or dtype.kind not in "iu" or fortran:
        raise DataError(f"{path}: got shape {list(shape)} of {dtype}; expected integer token ids "
                        f"of shape [n, {seq_len}] (data.seq_len)")
    row_bytes = seq_len * dtype.itemsize
    available = max(0, (path.stat().st_size - header_bytes) // row_bytes) if row_bytes else 0
    rows = min(shape[0], available)
    if rows < shape[0]:
        log.warning("%s is truncated: %d of %d rows readable; the rest are skipped as bad samples", path, rows,
                    shape[0])
    array = np.memmap(path, dtype=dtype, mode="r", offset=header_bytes, shape=(rows, seq_len)) if rows else (
        np.empty((0, seq_len), dtype=dtype))
    return array, int(shape[0])


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


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
    """Adds each key's index and loss weight to the sample, for the weighted loss and sample logs.

    A sample that cannot be read becomes its dataset's placeholder with weight 0 (like the
    padding of a short batch) and carries what went wrong, for the trainer to log and count.
    """

    def __init__(self, inner: Dataset):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, key: SampleKey) -> tuple[Any, Any, int, float, str]:
        try:
            inputs, target = self.inner[key]
        except BadSample as bad:
            inputs, target = self.inner.placeholder()
            return inputs, target, key.index, 0.0, str(bad) if key.weight else ""
        return inputs, target, key.index, key.weight, ""


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
