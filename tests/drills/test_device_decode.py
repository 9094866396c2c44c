"""Decoding on the device (``data.decode=device``): the workers send JPEG bytes and each sample's
crop; an ImageDecoder turns the batch into pixels. The CPU implementation of that interface is
tested here against the Pillow-in-the-workers path; nvJPEG's is tested the same way where CUDA
and torchvision's GPU decoder are present (the GPU image, or a GPU machine)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from training.config import load_train_config
from training.data.datasets import ImageFolder, Keyed
from training.data.transforms import Crop, apply_crop, crop_pillow_image, random_crop
from training.data.decode import EncodedImages, PillowDecoder, build_decoder, collate, nvjpeg_available
from training.data.feed import DeviceFeed
from training.device import detect
from training.data.imagenet import natural_image
from training.data.sampler import SampleKey
from tests.reference_libraries import needs_torchvision


@pytest.fixture
def folder(tmp_path):
    tmp_path = tmp_path / "images"
    tmp_path.mkdir()
    for label in range(2):
        (tmp_path / f"c{label}").mkdir()
        for i in range(5):
            pixels = natural_image(10 * label + i, 60 + 7 * i, 80 - 5 * i)
            Image.fromarray(pixels).save(tmp_path / f"c{label}" / f"{i}.jpg", quality=90)
        Image.fromarray(natural_image(label, 50, 50)).save(tmp_path / f"c{label}" / "z.png")  # the worker decodes it
    Image.fromarray(natural_image(99, 40, 60)[..., 0]).save(tmp_path / "c1" / "gray.jpg")
    return tmp_path


def keys(n: int) -> list[SampleKey]:
    return [SampleKey(i, 1.0, seed=100 + i) for i in range(n)]


def test_the_crop_is_drawn_from_the_seed_and_the_file_size_alone():
    assert random_crop(375, 500, seed=3) == random_crop(375, 500, seed=3)
    crops = {random_crop(375, 500, seed=s) for s in range(50)}
    assert len(crops) == 50 and {c.flip for c in crops} == {True, False}
    for crop in crops:
        assert crop.top >= 0 and crop.top + crop.height <= 375 and crop.left >= 0 and crop.left + crop.width <= 500


# torchvision 0.28.0's RandomResizedCrop.get_params (scale 0.08-1, ratio 3/4-4/3) and then
# RandomHorizontalFlip's draw, after torch.manual_seed(seed), as torchvision computed them; the
# last three are its fallback after ten misses, the central part within the ratio bounds.
TORCHVISIONS_CROPS = {
    (375, 500, 3): Crop(217, 343, 141, 112, True),
    (500, 375, 11): Crop(198, 102, 203, 201, False),
    (50, 300, 1): Crop(7, 41, 37, 44, False),
    (100, 1000, 0): Crop(0, 433, 100, 133, False),
    (1000, 100, 5): Crop(433, 0, 133, 100, False),
}


def test_the_crop_is_torchvisions_random_resized_crop_for_the_same_seed():
    for (height, width, seed), expected in TORCHVISIONS_CROPS.items():
        assert random_crop(height, width, seed) == expected, (height, width, seed)


def test_the_cpu_decoder_gives_the_workers_pixels_and_labels_exactly(folder):
    pillow = ImageFolder(folder, image_size=32)
    encoded = ImageFolder(folder, image_size=32, encoded=True)
    samples = [Keyed(encoded)[key] for key in keys(len(encoded))]
    batch = collate(samples)
    assert isinstance(batch[0], EncodedImages)
    assert len(batch[0].ready) == 3  # the PNGs and the grayscale JPEG arrive decoded; colour JPEGs as bytes
    pixels, problems = PillowDecoder()(batch[0], 32, torch.device("cpu"))
    assert problems == {}
    for key, image, label in zip(keys(len(pillow)), pixels, batch[1].tolist(), strict=True):
        expected, expected_label = pillow[key]
        assert torch.equal(image, expected) and label == expected_label


def test_a_file_that_fails_to_decode_is_padding_named_and_counted(folder):
    broken = folder / "c0" / "1.jpg"
    broken.write_bytes(broken.read_bytes()[:2000])  # the header whole (the scan starts at byte 609), the body cut
    dataset = ImageFolder(folder, image_size=32, encoded=True)
    position = [path for path, _ in dataset.samples].index(broken)
    batch = collate([Keyed(dataset)[key] for key in keys(len(dataset))])
    assert position not in batch[0].ready  # the worker read its header: it reaches the decoder encoded
    feed = DeviceFeed([batch], detect("cpu"), channels_last=True, decoder=PillowDecoder(), image_size=32)
    taken = feed.take()
    assert taken.weight[position] == 0 and taken.weight.sum() == len(dataset) - 1
    assert str(broken) in taken.problems[position]
    assert [i for i, p in enumerate(taken.problems) if p] == [position]


def test_the_feed_hands_out_every_batch_once_in_order_and_counts_the_wait():
    runtime = detect("cpu")
    batches = [(torch.randint(0, 256, (2, 4, 4, 3), dtype=torch.uint8), torch.tensor([i, i]), torch.tensor([i, i]),
                torch.ones(2), ["", ""]) for i in range(3)]
    feed = DeviceFeed(batches, runtime, channels_last=True)
    taken = [feed.take() for _ in range(3)]
    assert [b.target.tolist() for b in taken] == [[0, 0], [1, 1], [2, 2]]
    assert taken[0].inputs.dtype == torch.float32 and taken[0].inputs.shape == (2, 3, 4, 4)
    feed.ahead()  # nothing left: no error, and take says so
    with pytest.raises(StopIteration):
        feed.take()
    assert feed.data_wait_s >= 0


def test_decode_settings_pick_the_decoder():
    assert build_decoder("loader", "cpu") is None
    assert isinstance(build_decoder("device", "cpu"), PillowDecoder)


def test_training_with_device_decode_equals_training_with_worker_decode(folder, tmp_path):
    from training.loop.trainer import Trainer

    def run(decode: str) -> dict:
        work = tmp_path / decode
        config = load_train_config(None, [
            "--data.kind=imagefolder", f"--data.path={folder}", f"--data.decode={decode}", "--data.num_workers=2",
            "--model.name=mlp", "--model.image_size=16", "--model.num_classes=2", "--train.global_batch_size=4",
            "--train.micro_batch_size=2", "--train.max_steps=4", "--train.precision=fp32", "--train.device=cpu",
            "--train.log_every_steps=1", f"--checkpoint.dir={work}/ckpt", f"--metrics.jsonl_path={work}/m.jsonl",
        ])
        Trainer(config).run()
        losses = [r["loss"] for r in map(json.loads, (work / "m.jsonl").read_text().splitlines())
                  if r["event"] == "step"]
        weights = torch.load(next((work / "ckpt").glob("step-*.pt")), weights_only=True)["model"]
        return {"losses": losses, "weights": weights}

    device, loader = run("device"), run("loader")
    assert len(device["losses"]) == 4 and device["losses"] == loader["losses"]
    assert all(torch.equal(device["weights"][k], loader["weights"][k]) for k in loader["weights"])


@pytest.mark.skipif(not nvjpeg_available(), reason="needs CUDA and torchvision's nvJPEG (the GPU image)")
@pytest.mark.parametrize("subsampling, mean_bound", [(0, 1.5), (2, 6.0)])
def test_nvjpeg_gives_pillows_samples_within_interpolation_tolerance(folder, subsampling, mean_bound):
    from training.data.decode import NvjpegDecoder

    for path in folder.glob("*/*.jpg"):  # 4:4:4, or 4:2:0 (most photographs, ImageNet's too)
        with Image.open(path) as image:
            image.convert(image.mode).save(path, quality=90, subsampling=subsampling)
    pillow = ImageFolder(folder, image_size=64)
    batch = collate([Keyed(ImageFolder(folder, 64, encoded=True))[key] for key in keys(len(pillow))])
    pixels, problems = NvjpegDecoder()(batch[0], 64, torch.device("cuda"))
    assert problems == {} and pixels.device.type == "cuda"
    expected = torch.stack([pillow[key][0] for key in keys(len(pillow))])
    difference = (pixels.cpu().float() - expected.float()).abs()
    per_image = [(Path(s).name, round(float(d.mean()), 2), float(d.max()))
                 for s, d in zip(batch[0].sources, difference, strict=True)]
    print(subsampling, per_image)
    # The crop is the same; the decoders differ by their IDCT's rounding and, with 4:2:0, by how
    # they upsample chroma (libjpeg interpolates, nvJPEG replicates), largest at sharp colour edges.
    assert all(mean < mean_bound for _, mean, _ in per_image), per_image
    assert torch.equal(batch[1], torch.tensor([pillow[k][1] for k in keys(len(pillow))]))


def test_apply_crop_flips_and_resizes():
    image = torch.arange(3 * 4 * 6, dtype=torch.uint8).reshape(3, 4, 6)
    from training.data.transforms import Crop

    same = apply_crop(image, Crop(0, 0, 4, 6), 4)
    assert same.shape == (4, 4, 3)
    flipped = apply_crop(image, Crop(0, 0, 4, 6, flip=True), 4)
    assert torch.equal(flipped, same.flip(1))


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_the_workers_pillow_crop_is_torchs_antialiased_crop_within_one_level(mode):
    # Pillow rounds to uint8 between its two passes; with non-negative weights that moves a value
    # by less than one level. Pixels from outside the crop (a resize with a box) moved the edges
    # by up to 21 levels.
    image = Image.fromarray(natural_image(7, 375, 500)).convert(mode)
    reference = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
    crops = [random_crop(375, 500, seed) for seed in range(40)] + [Crop(0, 0, 375, 500), Crop(10, 20, 64, 64),
                                                                     Crop(3, 7, 40, 50)]
    assert any(c.height < 64 for c in crops) and any(c.height > 128 for c in crops)  # up- and downscaling
    for crop in crops:
        pixels = crop_pillow_image(image, crop, 64)
        assert pixels.shape == (64, 64, 3) and pixels.dtype == torch.uint8
        assert int((pixels.int() - apply_crop(reference, crop, 64).int()).abs().max()) <= 1, crop
    assert torch.equal(crop_pillow_image(image, Crop(10, 20, 64, 64), 64), reference[:, 10:74, 20:84].permute(1, 2, 0))
    mirrored = crop_pillow_image(image, Crop(5, 5, 100, 80, flip=True), 32)
    assert torch.equal(mirrored, crop_pillow_image(image, Crop(5, 5, 100, 80), 32).flip(1))


def test_a_background_feed_hands_out_the_same_batches_and_raises_what_the_loader_raised(folder):
    dataset = Keyed(ImageFolder(folder, image_size=16, encoded=True))
    batches = [collate([dataset[key] for key in keys(len(dataset))[i : i + 4]]) for i in (0, 4, 8)]
    runtime = detect("cpu")
    inline = DeviceFeed(batches, runtime, True, PillowDecoder(), 16, background=False)
    threaded = DeviceFeed(batches, runtime, True, PillowDecoder(), 16, background=True)
    for _ in batches:
        a, b = inline.take(), threaded.take()
        threaded.ahead()
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.target, b.target)
    with pytest.raises(StopIteration):
        threaded.take()
    threaded.close()

    def broken():
        yield batches[0]
        raise RuntimeError("DataLoader worker (pid 42) is killed by signal")

    feed = DeviceFeed(broken(), runtime, True, PillowDecoder(), 16, background=True)
    feed.take()
    feed.ahead()
    with pytest.raises(RuntimeError, match="killed by signal"):
        feed.take()
    feed.close()


def test_a_background_feed_starts_the_next_fetch_as_soon_as_a_batch_is_taken():
    """Measured on an H100: fetched only after the step's launches, the feed fell behind (data
    wait 10-15 %); fetched when the step takes its batch, the whole step hides it."""
    import threading

    requested = []
    both_requested = threading.Event()

    def loader():
        for i in range(3):
            requested.append(i)
            if len(requested) == 2:
                both_requested.set()
            yield (torch.zeros(1, 2, 2, 3, dtype=torch.uint8), torch.tensor([i]), torch.tensor([i]), torch.ones(1),
                   [""])

    feed = DeviceFeed(loader(), detect("cpu"), True, background=True)
    assert feed.take().target.tolist() == [0]
    assert both_requested.wait(5)  # batch 1 is on its way before the step even asks for it
    feed.close()


def test_the_batched_crop_and_resize_equals_torchs_antialiased_resize_of_each_crop():
    from training.data.transforms import Crop
    from training.data.decode import resize_crops

    generator = torch.Generator().manual_seed(0)
    images, crops = [], []
    for i in range(40):
        height, width = (int(v) for v in torch.randint(20, 300, (2,), generator=generator))
        images.append(torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator))
        drawn = random_crop(height, width, seed=i)
        crops.append(Crop(drawn.top, drawn.left, drawn.height, drawn.width))
    crops[0] = Crop(0, 0, images[0].shape[1], images[0].shape[2])  # the whole image
    crops[1] = Crop(3, 5, 7, 9)  # smaller than the output: upsampled
    batched = resize_crops(images, crops, 48)
    each = torch.stack([torch.nn.functional.interpolate(
        image[None, :, c.top : c.top + c.height, c.left : c.left + c.width].float(), size=(48, 48),
        mode="bilinear", antialias=True)[0] for image, c in zip(images, crops, strict=True)])
    assert batched.shape == (40, 3, 48, 48)
    assert torch.allclose(batched, each, atol=1e-3)  # float rounding only
    rounded = batched.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    expected = torch.stack([apply_crop(image, c, 48) for image, c in zip(images, crops, strict=True)])
    assert int((rounded.int() - expected.int()).abs().max()) <= 1
    # Chunks bounded by padded pixels (here one or two images each) give the same pixels.
    assert torch.allclose(resize_crops(images, crops, 48, pixel_budget=40_000), batched, atol=1e-4)


class KernelCount(TorchDispatchMode):
    """Counts the operators that compute (views only relabel memory, they launch nothing)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def test_the_device_decoder_launches_as_many_kernels_for_64_images_as_for_8():
    """On the GPU the decoder's work after nvJPEG runs on the feed thread, beside the thread
    launching the step: kernels per image there cost training time (per-image crops and resizes
    held ``decode: device`` at 0.52-0.66 of the bare loop on an H100)."""
    from training.data.transforms import Crop
    from training.data.decode import NvjpegDecoder

    def kernels(n: int) -> int:
        generator = torch.Generator().manual_seed(n)
        images, crops = [], []
        for i in range(n):
            height, width = (int(v) for v in torch.randint(40, 120, (2,), generator=generator))
            images.append(torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator))
            drawn = random_crop(height, width, seed=i)
            crops.append(Crop(drawn.top, drawn.left, drawn.height, drawn.width, flip=bool(i % 2)))
        decoder = object.__new__(NvjpegDecoder)  # nvJPEG's decode stands in as already done
        decoder._decode_jpeg, decoder._rgb, decoder._fallback = (lambda data, mode, device: images), None, None
        batch = EncodedImages(torch.zeros(n, dtype=torch.uint8), [1] * n, crops, {}, [""] * n)
        with KernelCount() as counted:
            pixels, problems = decoder(batch, 32, torch.device("cpu"))
        assert pixels.shape == (n, 32, 32, 3) and problems == {}
        return counted.count

    assert kernels(64) == kernels(8) < 100


def test_an_operator_called_through_torch_ops_lets_other_threads_run():
    """torchvision's GPU decode is ``torch.ops.image.decode_jpegs_cuda`` and waits for its
    stream before returning; the feed thread calls it beside the training thread. Through
    torch.ops the dispatcher runs a C++ operator without the GIL (shown here with a matmul,
    since torchvision's own wheels need CUDA torch), so that wait does not stall training."""
    import threading
    import time

    matrix = torch.randn(1200, 1200)
    spins, done = [0], threading.Event()

    def spin():
        while not done.is_set():
            spins[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        while spins[0] == 0:  # the spinner is running
            pass
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the spinner gets a core of its own
        try:
            def rate(wait) -> float:  # the spinner's increments per second while the main thread waits
                before, started = spins[0], time.perf_counter()
                wait()
                return (spins[0] - before) / (time.perf_counter() - started)

            free = rate(lambda: time.sleep(0.3))  # sleep releases the GIL
            in_operator = rate(lambda: [torch.ops.aten.mm.default(matrix, matrix) for _ in range(4)])
        finally:
            torch.set_num_threads(threads)
    finally:
        done.set()
        spinner.join()
    # Measured here: about 1.0 of the free rate. Code holding the GIL leaves the spinner a
    # switch interval or two: 4 % with sorted() of 3M floats in place of the matmuls.
    assert in_operator > 0.5 * free


@needs_torchvision
def test_the_workers_sample_is_torchvisions_random_resized_crop_and_flip(tmp_path):
    import torchvision.transforms.functional as tvf
    from torchvision.transforms import InterpolationMode, RandomResizedCrop

    sizes = [(375, 500), (500, 375), (224, 224), (480, 640), (60, 80), (100, 1000), (1000, 100), (50, 300), (2, 3)]
    for height, width in sizes:
        image = torch.empty(3, height, width)
        for seed in range(500):
            torch.manual_seed(seed)
            top, left, h, w = RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3])
            flip = bool(torch.rand(1) < 0.5)  # RandomHorizontalFlip(p=0.5)
            assert random_crop(height, width, seed) == Crop(top, left, h, w, flip), (height, width, seed)

    for seed in range(8):  # the pixels: Pillow's resize, as torchvision asks it, of ImageNet-sized JPEGs
        path = tmp_path / f"{seed}.jpg"
        Image.fromarray(natural_image(seed, 375, 500)).save(path, quality=90)
        with Image.open(path) as image:
            crop = random_crop(image.height, image.width, seed)
            ours = crop_pillow_image(image, crop, 48)
            theirs = tvf.resized_crop(image, crop.top, crop.left, crop.height, crop.width, [48, 48], InterpolationMode.BILINEAR)
            theirs = tvf.hflip(theirs) if crop.flip else theirs
        assert torch.equal(ours, torch.from_numpy(np.array(theirs))), seed


@needs_torchvision
def test_the_device_decoder_with_torchvisions_own_decode_on_the_cpu_matches_pillow(folder):
    """NvjpegDecoder as it is, torchvision's real decode_jpeg included, asked for the CPU: its
    calling convention (a list, ImageReadMode.RGB, CHW uint8 back), how a bad file fails the
    batched call, and the fallback to one by one and then to Pillow."""
    from training.data.decode import NvjpegDecoder

    encoded = ImageFolder(folder, image_size=32, encoded=True)
    order = keys(len(encoded))
    batch = collate([Keyed(encoded)[key] for key in order])
    pixels, problems = NvjpegDecoder()(batch[0], 32, torch.device("cpu"))
    reference, _ = PillowDecoder()(batch[0], 32, torch.device("cpu"))
    assert problems == {} and pixels.shape == reference.shape and pixels.dtype == torch.uint8
    assert batch[0].ready and len(batch[0].ready) < len(batch[0])  # the PNGs and the grayscale file came decoded
    # Both decoders are libjpeg-turbo here; what differs is the resize (one level, as above).
    assert int((pixels.int() - reference.int()).abs().max()) <= 1

    broken = folder / "c0" / "1.jpg"
    broken.write_bytes(broken.read_bytes()[:2000])  # the header whole (the scan starts at byte 609), the body cut
    position = [path for path, _ in encoded.samples].index(broken)
    batch = collate([Keyed(ImageFolder(folder, image_size=32, encoded=True))[key] for key in order])
    assert position not in batch[0].ready  # the worker read its header: it reaches the decoder encoded
    again, problems = NvjpegDecoder()(batch[0], 32, torch.device("cpu"))
    assert list(problems) == [position] and str(broken) in problems[position]
    others = [i for i in range(len(pixels)) if i != position]
    assert torch.equal(again[others], pixels[others])  # the rest decoded one by one, as in the batch


def test_the_device_decoders_logic_matches_pillows_with_the_jpeg_decode_done_by_pillow(folder):
    """NvjpegDecoder's crops, resizes, flips and fallbacks, on the CPU: only torchvision's
    decode_jpeg is replaced (by Pillow), since its wheels need CUDA."""
    from training.data.datasets import decode_image
    from training.data.decode import NvjpegDecoder

    unsupported = (folder / "c1" / "2.jpg").read_bytes()  # as nvJPEG might refuse, say, a rare JPEG variant
    calls = []

    def decode_jpeg(data, mode, device):
        calls.append(len(data) if isinstance(data, list) else 1)
        if isinstance(data, list):  # torchvision's batched call fails as a whole on one file
            return [decode_jpeg(one, mode, device) for one in data]
        if data.numpy().tobytes() == unsupported:
            raise RuntimeError("nvjpeg: unsupported")
        return decode_image(io.BytesIO(data.numpy().tobytes())).to(device)

    decoder = object.__new__(NvjpegDecoder)
    decoder._decode_jpeg, decoder._rgb, decoder._fallback = decode_jpeg, None, PillowDecoder()
    encoded = ImageFolder(folder, image_size=32, encoded=True)
    batch = collate([Keyed(encoded)[key] for key in keys(len(encoded))])
    pixels, problems = decoder(batch[0], 32, torch.device("cpu"))
    reference, _ = PillowDecoder()(batch[0], 32, torch.device("cpu"))
    assert problems == {} and calls[0] > 1  # the batch failed, then image by image, then Pillow for one
    assert pixels.shape == reference.shape and pixels.dtype == torch.uint8
    assert int((pixels.int() - reference.int()).abs().max()) <= 1
    assert any(c and c.flip for c in batch[0].crops) and any(c and not c.flip for c in batch[0].crops)
