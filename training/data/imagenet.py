"""Turn an ImageNet copy on the shared file system into the ImageFolder layout, and check it.

The ILSVRC validation set ships as 50,000 images in one folder plus a label file. ImageFolder
readers want ``val/<synset>/<image>``. This moves each image into its class folder (a rename:
no data is copied), is safe to run again, and writes a manifest of images per class.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from training.data.datasets import IMAGE_SUFFIXES

log = logging.getLogger(__name__)


class PrepareError(Exception):
    """The dataset is not where or what it should be; the message says what was found."""


def read_val_labels(path: str | Path) -> dict[str, str]:
    """Image stem -> synset, from Kaggle's LOC_val_solution.csv or 'ILSVRC2012_val_00000001.JPEG n01751748' lines."""
    path = Path(path)
    if not path.is_file():
        raise PrepareError(f"--labels: {path} does not exist; pass LOC_val_solution.csv or a 'file class' list")
    labels: dict[str, str] = {}
    with path.open(newline="") as handle:
        if path.suffix.lower() == ".csv":
            for row in csv.DictReader(handle):
                try:
                    labels[row["ImageId"]] = row["PredictionString"].split()[0]
                except (KeyError, IndexError):
                    raise PrepareError(f"{path}: expected columns ImageId,PredictionString") from None
        else:
            for number, line in enumerate(handle, 1):
                parts = line.split()
                if not parts:
                    continue
                if len(parts) != 2:
                    raise PrepareError(f"{path}:{number}: expected 'image class', got {line.strip()!r}")
                labels[Path(parts[0]).stem] = parts[1]
    if not labels:
        raise PrepareError(f"{path}: no labels found")
    return labels


def class_counts(folder: Path) -> dict[str, int]:
    return {
        d.name: sum(1 for f in d.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        for d in sorted(folder.iterdir())
        if d.is_dir()
    }


def rearrange_val(val: Path, labels: dict[str, str]) -> int:
    """Move flat images of ``val`` into class folders; returns how many moved."""
    flat = sorted(p for p in val.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    unlabelled = [p.name for p in flat if p.stem not in labels]
    if unlabelled:
        raise PrepareError(
            f"{val}: {len(unlabelled)} image(s) have no label in the label file, e.g. {unlabelled[0]}; "
            "nothing was moved"
        )
    for image in flat:
        target = val / labels[image.stem]
        target.mkdir(exist_ok=True)
        image.rename(target / image.name)
    return len(flat)


def _decode_problem(path: Path) -> str | None:
    """Why ``path`` cannot be decoded the way the trainer decodes it, or None."""
    from training.data.datasets import decode_image

    try:
        decode_image(path)
    except Exception as exc:  # noqa: BLE001 - whatever Pillow raises, it is this file's problem
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__
    return None


def verify_images(root: Path, workers: int | None = None) -> tuple[int, list[str]]:
    """(images checked, "relative/path: problem" for each one that does not decode), using every core."""
    images = sorted(p for split in ("train", "val") for p in (root / split).rglob("*")
                    if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    with ProcessPoolExecutor(workers or os.cpu_count()) as pool:
        problems = list(pool.map(_decode_problem, images, chunksize=64))
    return len(images), [f"{path.relative_to(root)}: {problem}"
                         for path, problem in zip(images, problems, strict=True) if problem]


def prepare_imagenet(root: str | Path, labels_path: str | Path, expect_classes: int, manifest: str | None,
                     verify: bool = False) -> dict:
    """Check train/ and val/ under ``root``, rearrange val/, write and return the manifest.

    ``verify`` also decodes every image; any that fail are listed in ``<root>/bad-images.txt``
    and the manifest, and the command fails naming how many and the first.
    """
    root = Path(root)
    train, val = root / "train", root / "val"
    for folder in (train, val):
        if not folder.is_dir():
            raise PrepareError(
                f"{folder} is not visible; is the dataset staged under the bucket's data prefix and imported "
                "by the file system's data repository association?"
            )
    moved = rearrange_val(val, read_val_labels(labels_path))
    counts = {"train": class_counts(train), "val": class_counts(val)}
    for split, per_class in counts.items():
        if len(per_class) != expect_classes:
            raise PrepareError(f"{root / split}: got {len(per_class)} class folders; expected {expect_classes}")
        empty = [name for name, n in per_class.items() if n == 0]
        if empty:
            raise PrepareError(f"{root / split}: {len(empty)} empty class folder(s), e.g. {empty[0]}")
    if set(counts["train"]) != set(counts["val"]):
        missing = sorted(set(counts["train"]) ^ set(counts["val"]))
        raise PrepareError(f"train and val classes differ, e.g. {missing[0]}")
    result = {
        "root": str(root),
        "classes": len(counts["train"]),
        "images": {split: sum(c.values()) for split, c in counts.items()},
        "moved_val_images": moved,
        "class_counts": counts,
    }
    bad: list[str] = []
    if verify:
        checked, bad = verify_images(root)
        result["verified_images"] = checked
        result["bad_images"] = bad
    target = Path(manifest) if manifest else root / "manifest.json"
    target.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    log.info("%d classes, %d train / %d val images; moved %d; manifest %s", result["classes"],
             result["images"]["train"], result["images"]["val"], moved, target)
    if bad:
        listing = root / "bad-images.txt"
        listing.write_text("\n".join(bad) + "\n")
        raise PrepareError(f"{len(bad)} of {result['verified_images']} images cannot be decoded, e.g. {bad[0]}; "
                           f"all are listed in {listing}; replace or remove them (training skips up to "
                           "data.max_bad_samples)")
    return result


# --- ImageNet-like JPEGs, for benchmarks and tests ---------------------------------------------


def natural_image(seed: int, height: int = 375, width: int = 500):
    """An RGB array that compresses like a photograph (smooth gradients, flat blocks, a little
    noise): at 500 x 375 and quality 90, about ImageNet's typical file size and decode cost."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    phase = rng.uniform(0, 6.3, 3)
    base = np.stack([127 + 100 * np.sin(x / (20 + 30 * i) + y / (25 + 20 * i) + phase[i]) for i in range(3)], -1)
    for _ in range(6):
        top, left = rng.integers(0, height * 3 // 4), rng.integers(0, width * 3 // 4)
        base[top : top + rng.integers(8, height // 3), left : left + rng.integers(8, width // 3)] = rng.integers(0, 255, 3)
    base += rng.normal(0, 20, base.shape)
    return base.clip(0, 255).astype(np.uint8)


def _write_one(job: tuple[str, int, int, int]) -> int:
    from PIL import Image

    path, seed, height, width = job
    Image.fromarray(natural_image(seed, height, width)).save(path, format="JPEG", quality=90)
    return Path(path).stat().st_size


def write_sample_jpegs(root: str | Path, count: int, classes: int = 10, height: int = 375, width: int = 500,
                       workers: int | None = None) -> int:
    """``count`` ImageNet-like JPEGs in ``root/<class>/``; returns their total bytes."""
    root = Path(root)
    jobs = []
    for i in range(count):
        folder = root / f"n{i % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        jobs.append((str(folder / f"{i:07d}.JPEG"), i, height, width))
    with ProcessPoolExecutor(workers or os.cpu_count()) as pool:
        return sum(pool.map(_write_one, jobs, chunksize=64))
