"""Image transforms in torch and Pillow, and what a sample failure is called: shared by the
datasets (:mod:`training.data.datasets`), the decoders (:mod:`training.data.decode`) and the device feed
(:mod:`training.device`), which import this module and not each other.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def generator_for(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def failure_reason(exc: BaseException) -> str:
    """One short line for a sample that could not be read: the error's type and its first line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


# --- image transforms, in torch ---------------------------------------------------------------


@dataclass(frozen=True)
class Crop:
    """Where to cut one image and whether to mirror it: drawn in the loader from the sample's
    seed, carried out by whichever decoder turns the file into pixels (:mod:`training.data.decode`)."""

    top: int
    left: int
    height: int
    width: int
    flip: bool = False


def random_crop(height: int, width: int, seed: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> Crop:
    """Inception-style augmentation of an image of ``height`` x ``width``: a random area and
    aspect ratio, and a coin flip for the mirror image.

    The draws, their float32 arithmetic and the fallback after ten misses are torchvision's
    (``RandomResizedCrop.get_params`` and ``RandomHorizontalFlip``, transforms/transforms.py,
    v0.28.0), from a generator seeded with ``seed`` instead of the global one: the same crop as
    torchvision's after ``torch.manual_seed(seed)`` (tests/drills/test_device_decode.py)."""
    generator = generator_for(seed)
    area = height * width
    log_ratio = _log_bounds(tuple(ratio))
    crop = None
    for _ in range(10):
        target = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator)).item()
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
            left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
            crop = Crop(top, left, h, w)
            break
    if crop is None:  # a panorama, say: the central part whose aspect ratio is within bounds
        h, w = height, width
        if width / height < min(ratio):
            h = round(width / min(ratio))
        elif width / height > max(ratio):
            w = round(height * max(ratio))
        crop = Crop((height - h) // 2, (width - w) // 2, h, w)
    flip = bool(torch.rand(1, generator=generator) < 0.5)
    return Crop(crop.top, crop.left, crop.height, crop.width, flip)


@functools.lru_cache(maxsize=8)
def _log_bounds(ratio: tuple[float, float]) -> tuple[float, float]:
    """The aspect ratio's bounds as logs, in float32 as torchvision takes them."""
    low, high = torch.log(torch.tensor(ratio)).tolist()
    return low, high


def center_crop(height: int, width: int, fraction: float = 0.875) -> Crop:
    """The central square, ``fraction`` of the shorter side: resized to 224 this is the classic
    "resize to 256, crop 224" evaluation view."""
    side = max(1, round(min(height, width) * fraction))
    return Crop((height - side) // 2, (width - side) // 2, side, side)


def apply_crop(image: Tensor, crop: Crop, size: int) -> Tensor:
    """uint8 [3, H, W] (on any device) cut to ``crop``, resized to ``size`` x ``size`` with
    antialiasing, mirrored if the crop says so: uint8 [size, size, 3]. The tensor form of
    :func:`crop_pillow_image`, and the reference for the device decoder's batched resize."""
    region = image[:, crop.top : crop.top + crop.height, crop.left : crop.left + crop.width].float()
    resized = F.interpolate(region[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
    if crop.flip:
        resized = resized.flip(-1)
    return resized.round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).contiguous()


# Images leave the loader as uint8 HWC: a quarter of float32's bytes to pin and copy, and the
# NHWC batch is already channels_last once permuted. The device converts and normalizes them
# (:func:`normalize_on_device`).


def normalize_on_device(images: Tensor) -> Tensor:
    """uint8 [N, H, W, 3] (on the device) as normalized float [N, 3, H, W] in channels_last memory."""
    mean, std = _normalization_constants(images.device)
    return (images.permute(0, 3, 1, 2).float() - mean) / std


@functools.lru_cache(maxsize=8)
def _normalization_constants(device: torch.device) -> tuple[Tensor, Tensor]:
    """ImageNet's mean and std (0-255 scale) on ``device``, copied there once: each copy from
    pageable memory waits for the stream (on an H100 the feed thread waited 0.3-0.6 ms a batch)."""
    return ((IMAGENET_MEAN * 255).to(device).view(1, 3, 1, 1), (IMAGENET_STD * 255).to(device).view(1, 3, 1, 1))


def eval_resize_size(size: int) -> int:
    """The shorter side an evaluation image is resized to before its central ``size`` square is
    cut: 256 for 224, as torchvision's ImageNet evaluation (references/classification/presets.py,
    ``ClassificationPresetEval``: ``resize_size=256``, ``crop_size=224``), in that proportion
    for other sizes (342 for 299, the resize torchvision's Inception-v3 weights are evaluated at)."""
    return int(round(size * 256 / 224))


def resize_center_crop_pillow(image, size: int) -> Tensor:
    """torchvision's evaluation transform of a Pillow image: ``Resize(eval_resize_size(size))``
    (the shorter side, bilinear with Pillow's antialiasing), then ``CenterCrop(size)``; uint8
    [size, size, 3].

    The arithmetic is torchvision's (transforms/functional.py, v0.28.0): the longer side becomes
    ``int(resize * long / short)`` (``_compute_resized_output_size``), the crop's corner
    ``int(round((side - size) / 2.0))`` (``center_crop``), and images are made RGB first, as its
    ImageFolder's loader does. Not the same pixels as :func:`center_crop` + :func:`apply_crop`
    (crop, then resize): resizing the whole image first samples it at other positions.
    """
    from PIL import Image

    rgb = image if image.mode == "RGB" else image.convert("RGB")
    resize = eval_resize_size(size)
    width, height = rgb.size
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = resize, int(resize * long / short)
    new_width, new_height = (new_short, new_long) if width <= height else (new_long, new_short)
    resized = rgb.resize((new_width, new_height), Image.Resampling.BILINEAR)
    top, left = int(round((new_height - size) / 2.0)), int(round((new_width - size) / 2.0))
    cropped = resized.crop((left, top, left + size, top + size))
    return torch.from_numpy(np.array(cropped, dtype=np.uint8))


def crop_pillow_image(image, crop: Crop, size: int) -> Tensor:
    """A Pillow image (still undecoded, if it was only opened) cut to ``crop``, resized to
    ``size`` x ``size``, mirrored if the crop says so: uint8 [size, size, 3].

    What torchvision's RandomResizedCrop does to a Pillow image: crop, then resize with the
    antialiased bilinear filter (transforms/functional.py ``resized_crop``). Pillow's filter
    has the same support and weights as torch's ``antialias=True`` (src/libImaging/Resample.c,
    ``precompute_coeffs``) but works on uint8 in fixed point and rounds between its horizontal
    and vertical passes, so a value is within one level of :func:`apply_crop`'s. A 500x375 JPEG
    takes 2.0 ms from file to sample this way, 2.7-2.8 ms decoded to a tensor and resized in
    float (one core, Pillow 13.0, torch 2.13).
    """
    from PIL import Image

    rgb = image if image.mode == "RGB" else image.convert("RGB")
    region = rgb.crop((crop.left, crop.top, crop.left + crop.width, crop.top + crop.height))
    resized = region.resize((size, size), Image.Resampling.BILINEAR)
    if crop.flip:
        resized = resized.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(resized, dtype=np.uint8))
