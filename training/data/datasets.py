"""Datasets keyed by :class:`~training.data.sampler.SampleKey`, and the loader that reads them.

Every random choice a sample needs (crop, flip, which tokens to mask) comes from the key's
seed, so a sample looks the same whichever rank reads it, before or after a restart.
"""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from training.config import TrainConfig, masked_per_sequence
from training.data.sampler import MicroBatchSampler, SampleKey
from training.data.transforms import (
    Crop, center_crop, crop_pillow_image, failure_reason, generator_for, random_crop, resize_center_crop_pillow,
)

if TYPE_CHECKING:
    from training.data.batch_slots import BatchSlots

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png"}
# BERT's uncased WordPiece vocabulary: [PAD]=0, [CLS]=101, [SEP]=102, [MASK]=103.
PAD_ID, CLS_ID, SEP_ID, MASK_ID = 0, 101, 102, 103
IGNORE_LABEL = -100
log = logging.getLogger(__name__)


class DataError(Exception):
    """A dataset that cannot be read as configured; the message says what was found and what is expected."""


class BadSample(Exception):
    """One sample that cannot be read (a corrupt image, a truncated shard): skipped, named and counted."""


# --- datasets ---------------------------------------------------------------------------------


def decode_image(path: str | Path | BinaryIO) -> Tensor:
    """An image file (its path, or the file open for reading) as a uint8 RGB tensor [3, H, W],
    decoded with Pillow."""
    from PIL import Image

    with Image.open(path) as img:
        return _rgb_tensor(img)


def _rgb_tensor(img) -> Tensor:
    array = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


class ImageFolder(Dataset):
    """``root/<class>/<image>`` read with Pillow; classes sorted by name, as torchvision does.

    ``encoded``: leave JPEGs encoded for the device to decode (:mod:`training.data.decode`); the
    worker reads only the header, for the size the crop is drawn in. ``train=False``: the
    evaluation view, torchvision's resize and center crop (:func:`resize_center_crop_pillow`),
    or with ``encoded`` the central square cut first and then resized, the one crop a decoder carries out.
    """

    def __init__(self, root: str | Path, image_size: int, train: bool = True, encoded: bool = False,
                 classes: list[str] | None = None, field: str = "data.path"):
        # ``classes``: the training set's, so that a validation set's labels are the same numbers
        # (it may lack some classes, never add one). ``field``: the config key its errors name.
        self.root = Path(root)
        if not self.root.is_dir():
            raise DataError(f"{field}: {self.root} is not a directory; expected <path>/<class>/<image>.jpg")
        found = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.classes = found if classes is None else list(classes)
        unknown = sorted(set(found) - set(self.classes))
        if unknown:
            raise DataError(f"{field}: class folder {unknown[0]} in {self.root} is not one of the training set's "
                            f"{len(self.classes)} classes; allowed: the class folders of data.path")
        labels = {name: label for label, name in enumerate(self.classes)}
        self.samples = [
            (path, labels[name])
            for name in found
            for path in sorted((self.root / name).iterdir())
            if path.suffix.lower() in IMAGE_SUFFIXES
        ]
        if not self.samples:
            raise DataError(f"{field}: no .jpg/.jpeg/.png images in class folders under {self.root}")
        self.image_size, self.train, self.encoded = image_size, train, encoded

    def __len__(self) -> int:
        return len(self.samples)

    def crop(self, height: int, width: int, seed: int) -> Crop:
        return random_crop(height, width, seed) if self.train else center_crop(height, width)

    def __getitem__(self, key: SampleKey) -> tuple[Any, int]:
        path, label = self.samples[key.index]
        try:
            if self.encoded:
                return self._encoded(path, key.seed), label
            from PIL import Image

            with Image.open(path) as image:  # the header gives the size; the crop decodes
                if not self.train:
                    return resize_center_crop_pillow(image, self.image_size), label
                crop = self.crop(image.height, image.width, key.seed)
                return crop_pillow_image(image, crop, self.image_size), label
        except Exception as exc:  # noqa: BLE001 - whatever Pillow raises for a bad file, the run goes on
            raise BadSample(f"{path}: {failure_reason(exc)}") from None

    def _encoded(self, path: Path, seed: int):
        from PIL import Image

        from training.data.decode import EncodedImage

        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            crop = self.crop(image.height, image.width, seed)
            if image.format != "JPEG" or image.mode != "RGB":
                # PNG, CMYK, grayscale: decoded by the worker as before (nvJPEG's RGB of those differs).
                return EncodedImage(torch.empty(0, dtype=torch.uint8), crop,
                                    crop_pillow_image(image, crop, self.image_size), str(path))
        return EncodedImage(torch.frombuffer(bytearray(data), dtype=torch.uint8), crop, None, str(path))

    def placeholder(self) -> tuple[Any, int]:
        """What stands in for a bad sample in its batch (with loss weight 0)."""
        pixels = torch.zeros(self.image_size, self.image_size, 3, dtype=torch.uint8)
        if self.encoded:
            from training.data.decode import EncodedImage

            return EncodedImage(torch.empty(0, dtype=torch.uint8), None, pixels), 0
        return pixels, 0


class SyntheticImages(Dataset):
    """Deterministic images per sample id: a class prototype plus noise, so a model can learn them.

    uint8 HWC like decoded images, so synthetic runs (the benchmarks) move the same bytes
    through the same device-side normalization as real ones.
    """

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int = 0, first_id: int = 0):
        # ``first_id``: sample ``i`` is image ``first_id + i``; a held-out split starts after the training ids.
        self.size, self.num_classes, self.image_size, self.first_id = size, num_classes, image_size, first_id
        prototypes = torch.randn(num_classes, image_size, image_size, 3, generator=generator_for(seed + 7))
        self.prototypes = prototypes.mul_(40).add_(100).round_().clamp_(0, 200).to(torch.uint8)

    def __len__(self) -> int:
        return self.size

    def placeholder(self) -> tuple[Tensor, int]:
        return torch.zeros(self.image_size, self.image_size, 3, dtype=torch.uint8), 0

    def __getitem__(self, key: SampleKey) -> tuple[Tensor, int]:
        generator = generator_for((self.first_id + key.index) * 7919 + 1)
        label = int(torch.randint(0, self.num_classes, (1,), generator=generator))
        # Integer noise: cheap enough that a few workers feed a GPU at thousands of images a second.
        noise = torch.randint(0, 56, (self.image_size, self.image_size, 3), dtype=torch.uint8, generator=generator)
        return self.prototypes[label] + noise, label


class MaskedLMShards(Dataset):
    """Pre-tokenized sequences in ``*.npy`` shards (shape [n, seq_len], integer token ids), memory-mapped.

    Masking is dynamic: each epoch masks other tokens, chosen from the key's seed. A shard cut
    short (an interrupted copy) keeps the rows its header promises: those past the end are bad
    samples, as are rows with token ids outside the vocabulary.
    """

    def __init__(self, root: str | Path, seq_len: int, vocab_size: int, mask_probability: float,
                 field: str = "data.path"):
        root = Path(root)
        self.paths = sorted(root.glob("*.npy")) if root.is_dir() else []
        if not self.paths:
            raise DataError(f"{field}: no *.npy token shards in {root}; expected arrays of shape [n, {seq_len}]")
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
        raise DataError(f"{path}: not a readable .npy file ({failure_reason(exc)}); allowed: integer token ids of shape "
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


class SyntheticTokens(MaskedLMShards):
    """Deterministic token sequences per sample id, for benchmarks."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, mask_probability: float, first_id: int = 0):
        self.size, self.seq_len, self.first_id = size, seq_len, first_id  # first_id: as SyntheticImages'
        self.vocab_size, self.mask_probability = vocab_size, mask_probability

    def __len__(self) -> int:
        return self.size

    def tokens(self, index: int) -> Tensor:
        body = torch.randint(1000, self.vocab_size, (self.seq_len - 2,),
                             generator=generator_for(self.first_id + index + 1))
        return torch.cat([torch.tensor([CLS_ID]), body, torch.tensor([SEP_ID])])


def mask_tokens(tokens: Tensor, seed: int, vocab_size: int, probability: float) -> tuple[Tensor, Tensor]:
    """BERT's masking: :func:`~training.config.masked_per_sequence` of the sequence's length
    without its [PAD] tokens (as google-research/bert's ``num_to_predict`` counts the unpadded
    tokens), drawn among the tokens that are not [PAD], [CLS] or [SEP] (all of those, if fewer);
    of them, 80 % become [MASK], 10 % a random token, 10 % stay. A full row gets exactly the
    head's ``max_predictions``, a padded one fewer."""
    generator = generator_for(seed)
    padding = tokens == PAD_ID
    special = padding | (tokens == CLS_ID) | (tokens == SEP_ID)
    count = min(masked_per_sequence(int((~padding).sum()), probability), int((~special).sum()))
    order = torch.rand(tokens.shape, generator=generator).masked_fill(special, 2.0)  # specials last
    chosen = torch.zeros(tokens.shape, dtype=torch.bool)
    chosen[order.topk(count, largest=False).indices] = True
    labels = torch.where(chosen, tokens, IGNORE_LABEL)
    roll = torch.rand(tokens.shape, generator=generator)
    inputs = torch.where(chosen & (roll < 0.8), MASK_ID, tokens)
    random_tokens = torch.randint(0, vocab_size, tokens.shape, generator=generator)
    inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_tokens, inputs)
    return inputs, labels


def attention_mask(inputs: Tensor, labels: Tensor) -> Tensor | None:
    """Which positions of a batch of masked-LM rows attention may look at (True: a real token),
    or None when no row has [PAD], so that attention keeps its fastest, unmasked kernel.

    Reference BERT feeds an ``input_mask`` that is 0 on the padding (google-research/bert,
    create_pretraining_data.py). Read on the host, before the batch's copy: deciding on the
    device whether there is any padding would make the host wait every step. A masked position
    is real even when its random replacement is [PAD]'s id. A row with no real token at all (a
    bad sample's placeholder, weight 0) may attend everywhere: attending to nothing gives NaN,
    which a weight of 0 does not cancel."""
    padding = (inputs == PAD_ID) & (labels == IGNORE_LABEL)
    if not bool(padding.any()):
        return None
    real = ~padding
    return real | ~real.any(dim=1, keepdim=True)


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


class Paced(Dataset):
    """``inner``'s samples at most ``per_s`` a second in the process that reads them, as storage of
    that bandwidth with a read-ahead buffer serves them: each read takes the next slot, and slots
    left unused while the process computed (up to ``CATCH_UP_S`` of them) are read at once, so a
    step costs about max(compute, batch / per_s). Each loader worker holds its own copy and pace."""

    # The read-ahead: after a pause (a step's compute, a checkpoint, a regroup) at most this much
    # reading is done already; a longer pause is not made up for by a longer burst.
    CATCH_UP_S = 0.25

    def __init__(self, inner: Dataset, per_s: float):
        self.inner, self.interval = inner, 1.0 / per_s
        self.next_slot = float("-inf")

    def __len__(self) -> int:
        return len(self.inner)

    def placeholder(self) -> tuple[Any, Any]:
        return self.inner.placeholder()

    def __getitem__(self, key: SampleKey) -> tuple[Any, Any]:
        now = time.monotonic()
        slot = max(self.next_slot, now - self.CATCH_UP_S)
        if slot > now:
            time.sleep(slot - now)
        self.next_slot = slot + self.interval
        return self.inner[key]


def build_dataset(config: TrainConfig, vocab_size: int | None = None, encoded: bool = False) -> Dataset:
    """The configured dataset; ``encoded``: JPEGs stay encoded for a device-side decoder."""
    data, model = config.data, config.model
    if data.kind == "imagefolder":
        return ImageFolder(data.path, model.image_size, encoded=encoded)
    if data.kind == "mlm_shards":
        return MaskedLMShards(data.path, data.seq_len, vocab_size, data.mask_probability)
    if model.is_masked_lm:
        synthetic = SyntheticTokens(data.synthetic_samples, data.seq_len, vocab_size, data.mask_probability)
    else:
        synthetic = SyntheticImages(data.synthetic_samples, model.num_classes, model.image_size, config.train.seed)
    return Paced(synthetic, data.synthetic_samples_per_s) if data.synthetic_samples_per_s else synthetic


def build_loader(dataset: Dataset, sampler: MicroBatchSampler, config: TrainConfig, pin_memory: bool,
                 slots: BatchSlots | None = None) -> DataLoader:
    """Micro-batches of keyed samples; with ``slots``, the workers write them into those shared
    slots and the loader yields only which slot holds each (:mod:`training.data.batch_slots`)."""
    from training.data.batch_slots import SlotFiller
    from training.data.decode import collate

    workers = config.data.num_workers
    keyed = Keyed(dataset)
    return DataLoader(
        SlotFiller(keyed, slots) if slots is not None else keyed,
        batch_sampler=slots.sampler(sampler) if slots is not None else sampler,
        num_workers=workers,
        pin_memory=pin_memory and slots is None,
        prefetch_factor=config.data.prefetch_factor if workers else None,
        persistent_workers=False,
        collate_fn=collate,
    )
