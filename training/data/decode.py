"""Where image files become pixels: in the loader's workers with Pillow, or on the device.

With ``data.decode=device`` a worker only reads the file and draws the sample's crop and flip
from its seed (:func:`training.data.datasets.random_crop`); the bytes travel still encoded (a fifth of
the decoded image), and an :class:`ImageDecoder` in the training process turns the whole batch
into uint8 NHWC pixels on the device. The crops are the same either way, so both paths train on
the same samples and labels. The values differ by about a level for 4:4:4 JPEGs (the IDCTs'
rounding, and Pillow's resize rounding between its two passes where the device's does not) and
by a few levels for 4:2:0 ones, where nvJPEG and libjpeg upsample chroma differently
(tests/drills/test_device_decode.py, run on an H100 before Pillow resized in the workers). Grayscale,
CMYK and PNG files are decoded by the worker, as before.

Two decoders share one small interface: :class:`NvjpegDecoder` (nvJPEG through
``torchvision.io.decode_jpeg(device="cuda")``, in the GPU image) and :class:`PillowDecoder`
(Pillow on the CPU: the reference, and what tests and CPU runs use).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils.data import default_collate

from training.data.batch_slots import FilledSlot
from training.data.transforms import Crop, crop_pillow_image, failure_reason
from training.device import DeviceError


@dataclass
class EncodedImage:
    """One sample as a worker leaves it: the file's bytes and its crop, or, for what the device
    cannot decode (PNG, CMYK), the finished pixels."""

    data: Tensor  # uint8 [n], the file as it is on disk
    crop: Crop | None
    ready: Tensor | None = None  # uint8 [size, size, 3], already decoded and cropped in the worker
    source: str = ""


@dataclass
class EncodedImages:
    """A batch of :class:`EncodedImage`, the files end to end in one buffer: one tensor for the
    worker to share and the loader to pin, not one per image (hundreds of shared-memory files a
    batch would cap the workers at a few thousand images a second)."""

    buffer: Tensor  # uint8, every file's bytes end to end
    lengths: list[int]
    crops: list[Crop | None]
    ready: dict[int, Tensor] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, images: list[EncodedImage]) -> "EncodedImages":
        return cls(torch.cat([image.data for image in images]), [image.data.numel() for image in images],
                   [image.crop for image in images],
                   {i: image.ready for i, image in enumerate(images) if image.ready is not None},
                   [image.source for image in images])

    @property
    def data(self) -> list[Tensor]:
        """Each file's bytes: views into the buffer."""
        return list(torch.split(self.buffer, self.lengths))

    def __len__(self) -> int:
        return len(self.lengths)

    def pin_memory(self) -> "EncodedImages":
        # Pinned bytes let nvJPEG's copy to the device run without a staging copy.
        return EncodedImages(self.buffer.pin_memory(), self.lengths, self.crops,
                             {i: r.pin_memory() for i, r in self.ready.items()}, self.sources)

    def one(self, i: int) -> "EncodedImages":
        data = self.data[i]
        return EncodedImages(data, [data.numel()], [self.crops[i]], {}, [self.sources[i]])


def collate(samples: list[tuple[Any, ...]]) -> Any:
    """The default collation, except that encoded images stay a list (their lengths differ) and a
    batch written into its slot (:mod:`training.data.batch_slots`) is passed on as it is."""
    if isinstance(samples, FilledSlot):
        return samples
    if samples and isinstance(samples[0][0], EncodedImage):
        return (EncodedImages.of([s[0] for s in samples]), *default_collate([s[1:] for s in samples]))
    return default_collate(samples)


class ImageDecoder(Protocol):
    """Encoded images to uint8 [N, size, size, 3] on ``device``, and the positions that could not
    be decoded (their pixels are zeros), each with the reason."""

    def __call__(self, batch: EncodedImages, size: int, device: torch.device) -> tuple[Tensor, dict[int, str]]: ...


class PillowDecoder:
    """The reference decoder: Pillow on the CPU, then the crop; the batch is copied to ``device``."""

    def __call__(self, batch: EncodedImages, size: int, device: torch.device) -> tuple[Tensor, dict[int, str]]:
        from PIL import Image

        out = torch.zeros(len(batch), size, size, 3, dtype=torch.uint8)
        problems: dict[int, str] = {}
        for i, (data, crop) in enumerate(zip(batch.data, batch.crops, strict=True)):
            if i in batch.ready:
                out[i] = batch.ready[i]
                continue
            try:
                with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
                    out[i] = crop_pillow_image(image, crop, size)
            except Exception as exc:  # noqa: BLE001 - whatever Pillow raises for a bad file, the run goes on
                problems[i] = f"{batch.sources[i]}: {failure_reason(exc)}"
        return out.to(device, non_blocking=True), problems


def resize_crops(images: list[Tensor], crops: list[Crop], size: int, pixel_budget: int = 1 << 25) -> Tensor:
    """uint8 [3, H, W] images, each cut to its crop and resized to ``size`` x ``size`` with
    antialiasing as :func:`training.data.transforms.apply_crop` does, without the flips: float [N, 3, size, size].

    A fixed number of kernels per chunk of images, not a few per image: the crops are gathered
    into one padded batch and resized as two batched matrix products. The weights are torch's
    antialiased bilinear ones (ATen ``_compute_indices_min_size_weights_aa``: center
    scale * (i + 0.5), support max(scale, 1), a triangle filter scaled by 1 / scale when
    downsampling, normalized), zero past each crop's own height and width. A chunk holds at
    most ``pixel_budget`` padded pixels, so one large photo does not pad a whole batch.
    """
    device = images[0].device
    out = torch.empty(len(images), 3, size, size, device=device)
    # Weights for the whole batch at once (a few kernels), sliced per chunk.
    all_rows = _antialias_weights([c.height for c in crops], max(c.height for c in crops), size, device)
    all_columns = _antialias_weights([c.width for c in crops], max(c.width for c in crops), size, device)
    start = 0
    while start < len(images):
        end, tall, wide = start, 0, 0
        while end < len(images):
            crop = crops[end]
            grown = (end + 1 - start) * 3 * max(tall, crop.height) * max(wide, crop.width)
            if end > start and grown > pixel_budget:
                break
            tall, wide, end = max(tall, crop.height), max(wide, crop.width), end + 1
        pixels = _gather_crops(images[start:end], crops[start:end], tall, wide)
        rows, columns = all_rows[start:end, :, :tall], all_columns[start:end, :, :wide]
        out[start:end] = rows[:, None] @ pixels @ columns[:, None].transpose(-1, -2)
        start = end
    return out


def _gather_crops(images: list[Tensor], crops: list[Crop], tall: int, wide: int) -> Tensor:
    """float [n, 3, tall, wide]: each crop at the top left, its last row and column repeated
    beyond it (those pixels get weight 0)."""
    device = images[0].device
    flat = torch.cat([image.reshape(-1) for image in images])
    starts, offset = [], 0
    for image in images:
        starts.append(offset)
        offset += image.numel()
    # Per image: where its crop starts in ``flat``, its plane and row strides, its crop's size.
    layout = torch.tensor([[start + c.top * image.shape[2] + c.left, image.shape[1] * image.shape[2],
                            image.shape[2], c.height, c.width] for start, c, image in zip(starts, crops, images, strict=True)])
    layout = _to_device(layout, device)
    first, plane, row, height, width = layout.unbind(1)
    y = torch.minimum(torch.arange(tall, device=device)[None], height[:, None] - 1)  # [n, tall]
    x = torch.minimum(torch.arange(wide, device=device)[None], width[:, None] - 1)  # [n, wide]
    channel = torch.arange(3, device=device)[None, :, None, None] * plane[:, None, None, None]
    index = first[:, None, None, None] + channel + (y * row[:, None])[:, None, :, None] + x[:, None, None, :]
    return flat[index].float()


def _antialias_weights(lengths: list[int], span: int, size: int, device: torch.device) -> Tensor:
    """[n, size, span]: output i of each row takes these weights of source positions 0..span-1
    (torch's antialiased bilinear weights for a source of ``lengths[k]``, zero past it)."""
    length = _to_device(torch.tensor(lengths, dtype=torch.float32), device)[:, None, None]
    scale = length / size
    support = scale.clamp(min=1.0)
    inverse = torch.where(scale >= 1.0, 1.0 / scale, torch.ones_like(scale))
    center = scale * (torch.arange(size, device=device, dtype=torch.float32)[None, :, None] + 0.5)
    source = torch.arange(span, device=device, dtype=torch.float32)[None, None, :]
    first = (center - support + 0.5).trunc().clamp(min=0.0)
    last = torch.minimum((center + support + 0.5).trunc(), length)
    weights = (1.0 - ((source - center + 0.5) * inverse).abs()).clamp(min=0.0)
    weights = weights * ((source >= first) & (source < last))
    total = weights.sum(-1, keepdim=True)
    return weights / torch.where(total > 0, total, torch.ones_like(total))


def _to_device(small: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on ``device`` without waiting: from pageable memory a copy to a GPU
    synchronizes the stream (on an H100 that was 0.3-0.6 ms a batch in the feed thread)."""
    return small.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else small.to(device)


class NvjpegDecoder:
    """nvJPEG on the GPU: one batched call (the hardware JPEG engines on A100 and H100, where
    the JPEG is baseline), then the crops and resizes of the whole batch (:func:`resize_crops`).

    torchvision's batched decode fails as a whole when one file is bad; then each image is
    decoded alone, and what nvJPEG cannot read goes to Pillow before it counts as a bad sample.
    """

    def __init__(self) -> None:
        from torchvision.io import ImageReadMode, decode_jpeg  # the GPU image only: PyPI's wheels need CUDA torch

        self._decode_jpeg, self._rgb = decode_jpeg, ImageReadMode.RGB
        self._fallback = PillowDecoder()

    def __call__(self, batch: EncodedImages, size: int, device: torch.device) -> tuple[Tensor, dict[int, str]]:
        todo = [i for i in range(len(batch)) if i not in batch.ready]
        data = batch.data
        decoded = self._decode_all([data[i] for i in todo], device)
        finished = {i: ready.to(device, non_blocking=True) for i, ready in batch.ready.items()}  # uint8 HWC
        problems: dict[int, str] = {}
        for i, image in zip(todo, decoded, strict=True):
            if not isinstance(image, Tensor):
                fallback, failed = self._fallback(batch.one(i), size, device)  # what nvJPEG could not read
                finished[i] = fallback[0]
                if failed:
                    problems[i] = failed[0]
        # One crop-and-resize for the batch: this runs on the feed thread, which shares the GIL
        # with training, so a few kernels per chunk of images beat a few per image.
        good = [(i, image) for i, image in zip(todo, decoded, strict=True) if isinstance(image, Tensor)]
        positions = [i for i, _ in good]
        cropped = resize_crops([image for _, image in good], [batch.crops[i] for i in positions], size) if good else None
        if len(positions) == len(batch):
            resized = cropped
        else:  # the other positions come from ``finished``
            resized = torch.empty(len(batch), 3, size, size, device=device)
            if good:
                resized[_to_device(torch.tensor(positions), device)] = cropped
        # The mirror images, rounding and layout for the whole batch at once: few kernels, not per image.
        flips = _to_device(torch.tensor([bool(c and c.flip) for c in batch.crops]), device).view(-1, 1, 1, 1)
        resized = torch.where(flips, resized.flip(-1), resized)
        out = resized.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
        for i, pixels in finished.items():  # already cropped, mirrored and rounded
            out[i] = pixels
        return out, problems

    def _decode_all(self, data: list[Tensor], device: torch.device) -> list[Tensor | BaseException]:
        if not data:
            return []
        # torchvision decodes on a stream of its own and waits for it before returning
        # (torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp, decode_images): this thread
        # blocks, but without the GIL (a torch.ops call releases it), so training goes on.
        try:
            return self._decode_jpeg(data, mode=self._rgb, device=device)
        except RuntimeError:
            pass
        results: list[Tensor | BaseException] = []
        for one in data:
            try:
                results.append(self._decode_jpeg(one, mode=self._rgb, device=device))
            except RuntimeError as exc:
                results.append(exc)
        return results


def nvjpeg_available() -> bool:
    try:
        from torchvision.io import decode_jpeg  # noqa: F401 - imported to see whether it loads
    except Exception:  # noqa: BLE001 - not installed, or a wheel built for another torch
        return False
    return torch.cuda.is_available()


def build_decoder(setting: str, device_kind: str) -> ImageDecoder | None:
    """The decoder for ``data.decode``; None where the workers decode (``loader``)."""
    if setting == "loader":
        return None
    if device_kind == "cuda":
        if not nvjpeg_available():
            raise DeviceError("data.decode: got \"device\" but torchvision.io's nvJPEG decoder is not importable "
                              "here (it ships in the GPU image); allowed here: loader")
        return NvjpegDecoder()
    return PillowDecoder()  # CPU (and tests): the same interface, decoded in the training process
