"""The validation split: where it is, how its samples are read, and which of them each rank evaluates.

Unlike training, evaluation is a pure function of the weights: no augmentation (images get the
evaluation view), and a masked-LM sequence is masked the same way every time (its mask drawn
from a seed fixed per sequence, the same for every run whatever its ``train.seed``, so runs can
be compared on the same masks).
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch.utils.data import Dataset

from training.config import IMAGENET_TRAIN_IMAGES, IMAGENET_VAL_IMAGES, TrainConfig
from training.data.datasets import DataError, ImageFolder, MaskedLMShards, SyntheticImages, SyntheticTokens
from training.data.sampler import SampleKey, sample_seed

log = logging.getLogger(__name__)
# The masks' seed: any fixed number, so that every evaluation of every run masks alike.
EVAL_MASK_SEED = 20_181_011


def validation_path(config: TrainConfig) -> Path | None:
    """eval.path, or val/ beside data.path when that folder is named train; None when neither."""
    if config.eval.path:
        return Path(config.eval.path)
    data_path = Path(config.data.path)
    return data_path.parent / "val" if data_path.name == "train" else None


def synthetic_eval_samples(config: TrainConfig) -> int:
    """eval.synthetic_samples, or ImageNet's validation share of data.synthetic_samples (at least 1)."""
    if config.eval.synthetic_samples:
        return config.eval.synthetic_samples
    return max(1, round(config.data.synthetic_samples * IMAGENET_VAL_IMAGES / IMAGENET_TRAIN_IMAGES))


def build_validation_dataset(config: TrainConfig, vocab_size: int | None, train_set: Dataset) -> Dataset | None:
    """The validation set of ``config``, or None when evaluation is off.

    synthetic: held-out samples, the ids after the training set's (the same classes and
    prototypes, other noise). imagefolder and mlm_shards: the directory :func:`validation_path`
    names, which must exist when it is named; a data.path not named train and no eval.path
    turns evaluation off, with a warning (there is no val/ to guess).
    """
    data, model = config.data, config.model
    if not config.eval.enabled:
        return None
    if data.kind == "synthetic":
        size = synthetic_eval_samples(config)
        if model.is_masked_lm:
            return SyntheticTokens(size, data.seq_len, vocab_size, data.mask_probability, first_id=data.synthetic_samples)
        return SyntheticImages(size, model.num_classes, model.image_size, config.train.seed,
                               first_id=data.synthetic_samples)
    path = validation_path(config)
    if path is None:
        log.warning("evaluation is off: eval.path is not set and data.path %s is not a folder named train with val/ "
                    "beside it; set eval.path, or eval.enabled=false to silence this", data.path)
        return None
    if not path.is_dir():
        named = "" if config.eval.path else " (val/ beside data.path)"
        raise DataError(f"eval.path: {path}{named} is not a directory; allowed: the validation set in "
                        f"{data.kind}'s layout (prepare-imagenet makes ImageNet's), or eval.enabled=false")
    if data.kind == "imagefolder":
        return ImageFolder(path, model.image_size, train=False, classes=getattr(train_set, "classes", None),
                           field="eval.path")
    return MaskedLMShards(path, data.seq_len, vocab_size, data.mask_probability, field="eval.path")


def eval_batch_size(config: TrainConfig) -> int:
    return config.eval.batch_size or config.train.micro_batch_size


def batch_count(samples: int, batch_size: int) -> int:
    return -(-samples // batch_size)


def rank_batches(samples: int, batch_size: int, rank: int, world_size: int) -> list[tuple[int, list[SampleKey]]]:
    """Rank ``rank``'s batches of the validation set, each with its number: the set is cut into
    batches of ``batch_size`` in index order (the last one short) and they are dealt out in turn.

    Nothing is padded, so each sample is evaluated once, by one rank, whatever the world size
    (torch's DistributedSampler pads every rank to the same count with repeated samples, which
    would count those twice: torch/utils/data/distributed.py, torch 2.13.0). A sample's batch,
    and so its companions, are the same at every world size: its figures do not depend on how
    many ranks there are.
    """
    batches = []
    for number in range(rank, batch_count(samples, batch_size), world_size):
        indices = range(number * batch_size, min(samples, (number + 1) * batch_size))
        batches.append((number, [SampleKey(i, 1.0, sample_seed(EVAL_MASK_SEED, 0, i)) for i in indices]))
    return batches
