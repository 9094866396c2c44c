"""A corrupt JPEG or a truncated token shard costs its samples, not the run: each is named,
counted and skipped once, the exactly-once accounting stays whole, and a limit ends a run whose
data is broken rather than merely dented."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = [pytest.mark.untimed, pytest.mark.timeout(300)]
CLASSES = 3
PER_CLASS = 6


def image_folder(root: Path) -> list[Path]:
    from PIL import Image

    paths = []
    for label in range(CLASSES):
        (root / f"class{label}").mkdir(parents=True)
        for i in range(PER_CLASS):
            path = root / f"class{label}" / f"{i}.jpg"
            Image.new("RGB", (24, 20), (40 * label, 255 - 30 * i, 90)).save(path, format="JPEG")
            paths.append(path)
    return paths


def train(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "training", "train", "--data.num_workers=2", "--train.epochs=1",
         "--train.precision=fp32", "--train.device=cpu", "--train.log_every_steps=1",
         f"--checkpoint.dir={work}/checkpoints", "--checkpoint.interval_steps=2",
         f"--metrics.jsonl_path={work}/metrics.jsonl", f"--metrics.sample_log_dir={work}/samples", *args],
        cwd=REPO, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})


def events(work: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (work / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


def coverage(work: Path) -> tuple[Counter, Counter]:
    trained, skipped = Counter(), Counter()
    for log in (work / "samples").glob("*.jsonl"):
        for record in map(json.loads, log.read_text().splitlines()):
            trained.update(record["ids"])
            skipped.update(record.get("skipped", []))
    return trained, skipped


def image_args(root: Path) -> list[str]:
    return ["--data.kind=imagefolder", f"--data.path={root}", "--model.name=mlp", "--model.image_size=16",
            f"--model.num_classes={CLASSES}", "--train.global_batch_size=6", "--train.micro_batch_size=3"]


def test_a_corrupt_jpeg_is_skipped_once_named_and_counted(tmp_path):
    paths = image_folder(tmp_path / "images")
    broken = paths[7]
    broken.write_bytes(b"not a jpeg at all")
    result = train(tmp_path, *image_args(tmp_path / "images"))
    assert result.returncode == 0, result.stderr[-3000:]
    named = [line for line in result.stderr.splitlines() if "skipping sample" in line]
    assert len(named) == 1 and f"{broken}: UnidentifiedImageError: cannot identify image file" in named[0]
    assert events(tmp_path, "finished")[-1]["bad_samples"] == 1
    trained, skipped = coverage(tmp_path)
    assert skipped == Counter({7: 1}) and 7 not in trained  # never trained on, skipped exactly once
    assert set(trained) | set(skipped) == set(range(CLASSES * PER_CLASS))
    assert set(trained.values()) == {1}


def test_past_the_limit_the_run_ends_with_one_line(tmp_path):
    paths = image_folder(tmp_path / "images")
    for broken in paths[:2]:
        broken.write_bytes(broken.read_bytes()[:30])  # cut short
    result = train(tmp_path, *image_args(tmp_path / "images"), "--data.max_bad_samples=1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: data.max_bad_samples: 2 samples could not be read, more than the allowed 1")


def shard(path: Path, rows: np.ndarray) -> None:
    np.save(path, rows.astype(np.int32))


def test_a_truncated_shard_and_out_of_vocabulary_tokens_cost_only_their_rows(tmp_path):
    rng = np.random.default_rng(0)
    data = tmp_path / "shards"
    data.mkdir()
    first = rng.integers(1000, 30000, size=(12, 16))
    first[3, 5] = 99_999  # not a token id of BERT's vocabulary
    shard(data / "000.npy", first)
    shard(data / "001.npy", rng.integers(1000, 30000, size=(12, 16)))
    cut = data / "001.npy"
    cut.write_bytes(cut.read_bytes()[: -16 * 4 * 3 - 7])  # an interrupted copy: 3 rows and a bit gone
    result = train(tmp_path, "--data.kind=mlm_shards", f"--data.path={data}", "--model.name=bert_tiny",
                   "--data.seq_len=16", "--train.global_batch_size=8", "--train.micro_batch_size=8")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "001.npy is truncated: 8 of 12 rows readable" in result.stderr
    trained, skipped = coverage(tmp_path)
    assert skipped == Counter({3: 1, 20: 1, 21: 1, 22: 1, 23: 1})  # the bad row of 000, the lost rows of 001
    assert set(trained) | set(skipped) == set(range(24)) and set(trained.values()) == {1}
    assert events(tmp_path, "finished")[-1]["bad_samples"] == 5


def test_a_shard_whose_header_is_unreadable_is_one_line_at_startup(tmp_path):
    data = tmp_path / "shards"
    data.mkdir()
    (data / "000.npy").write_bytes(b"\x93NUMPY garbage")
    result = train(tmp_path, "--data.kind=mlm_shards", f"--data.path={data}", "--model.name=bert_tiny",
                   "--data.seq_len=16", "--train.global_batch_size=8", "--train.micro_batch_size=8")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {data}/000.npy: not a readable .npy file (")
