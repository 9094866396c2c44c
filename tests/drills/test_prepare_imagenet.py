"""prepare-imagenet: the validation folder rearranged into class folders, checked, with a manifest."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = pytest.mark.untimed

CLASSES = ["n01440764", "n01443537", "n01484850"]


@pytest.fixture
def imagenet(tmp_path):
    root = tmp_path / "imagenet"
    for synset in CLASSES:
        (root / "train" / synset).mkdir(parents=True)
        for i in range(2):
            (root / "train" / synset / f"{synset}_{i}.JPEG").write_bytes(b"jpeg")
    (root / "val").mkdir()
    rows = ["ImageId,PredictionString"]
    for i in range(6):
        name = f"ILSVRC2012_val_{i + 1:08d}"
        (root / "val" / f"{name}.JPEG").write_bytes(b"jpeg")
        rows.append(f"{name},{CLASSES[i % 3]} 10 20 30 40 {CLASSES[i % 3]} 1 2 3 4")
    labels = tmp_path / "LOC_val_solution.csv"
    labels.write_text("\n".join(rows) + "\n")
    return root, labels


def prepare(root, labels, *extra):
    return subprocess.run(
        [sys.executable, "-m", "training", "prepare-imagenet", str(root), "--labels", str(labels),
         "--expect-classes", "3", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )


def test_val_images_move_into_class_folders_and_a_manifest_is_written(imagenet):
    root, labels = imagenet
    result = prepare(root, labels)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (root / "val").iterdir()) == CLASSES
    assert (root / "val" / CLASSES[1] / "ILSVRC2012_val_00000002.JPEG").exists()
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["classes"] == 3 and manifest["images"] == {"train": 6, "val": 6}
    assert manifest["class_counts"]["val"] == dict.fromkeys(CLASSES, 2)
    again = prepare(root, labels)  # safe to run twice: nothing left to move
    assert again.returncode == 0 and json.loads((root / "manifest.json").read_text())["moved_val_images"] == 0


def test_a_dataset_that_is_not_imported_yet_is_one_clear_error(tmp_path, imagenet):
    _, labels = imagenet
    result = prepare(tmp_path / "nowhere", labels)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "is not visible" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_image_without_a_label_moves_nothing(imagenet):
    root, labels = imagenet
    (root / "val" / "ILSVRC2012_val_00000099.JPEG").write_bytes(b"jpeg")
    result = prepare(root, labels)
    assert result.returncode == 2 and "1 image(s) have no label" in result.stderr
    assert not any(p.is_dir() for p in (root / "val").iterdir())


def test_a_wrong_class_count_fails(imagenet):
    root, labels = imagenet
    result = subprocess.run(
        [sys.executable, "-m", "training", "prepare-imagenet", str(root), "--labels", str(labels)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "got 3 class folders; expected 1000" in result.stderr


def test_verify_names_every_image_that_does_not_decode(imagenet):
    from PIL import Image

    root, labels = imagenet
    for image in [*root.glob("train/*/*.JPEG"), *root.glob("val/*.JPEG")]:
        Image.new("RGB", (8, 6), (10, 200, 30)).save(image, format="JPEG")
    broken = root / "train" / CLASSES[2] / f"{CLASSES[2]}_1.JPEG"
    broken.write_bytes(broken.read_bytes()[:40])  # cut short, as an interrupted copy leaves it
    assert prepare(root, labels).returncode == 0  # without --verify nothing is decoded
    result = prepare(root, labels, "--verify")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: 1 of 12 images cannot be decoded, e.g. train/n01484850/n01484850_1.JPEG")
    listed = (root / "bad-images.txt").read_text().splitlines()
    assert len(listed) == 1 and listed[0].startswith("train/n01484850/n01484850_1.JPEG: ")
    assert json.loads((root / "manifest.json").read_text())["bad_images"] == listed
    broken.unlink()
    assert prepare(root, labels, "--verify").returncode == 0
