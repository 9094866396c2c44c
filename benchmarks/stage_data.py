"""stage-data's files per second, at the default concurrency and one file at a time.

    .venv/bin/python benchmarks/stage_data.py            # 10,000 files of 4 KiB, 50 ms per request

Against moto's S3 in its own process (tests/local_s3.py), which delays every request by the
round trip the issue measured to S3 (~50 ms per file). Both rates are measured in one run, side
by side, each into a fresh bucket: one at a time on --serial-files files (latency-bound, so a
sample gives the rate), then all --files at the default concurrency.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.local_s3 import local_s3
from trainctl.__main__ import _s3_pool
from trainctl.stage import DEFAULT_CONCURRENCY, stage_data


def make_files(root: Path, count: int, size: int) -> Path:
    for i in range(count):
        folder = root / f"n{i % 100:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:08d}.JPEG").write_bytes(os.urandom(size))
    return root


def rate(endpoint: str, source: Path, bucket: str, concurrency: int) -> tuple[float, int]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-west-2", aws_access_key_id="testing",
                      aws_secret_access_key="testing", config=_s3_pool(concurrency))  # local server
    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    start = time.perf_counter()
    result = stage_data(source, s3, bucket, "datasets/", concurrency=concurrency)
    elapsed = time.perf_counter() - start
    return result.uploaded / elapsed, result.uploaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--serial-files", type=int, default=1_000)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        everything = make_files(Path(tmp) / "all", args.files, args.size)
        sample_files = make_files(Path(tmp) / "serial", args.serial_files, args.size)
        print(f"{args.files:,} files of {args.size} B, {args.latency * 1000:.0f} ms per request; serial rate from "
              f"{args.serial_files:,} files")
        with local_s3(args.latency) as endpoint:
            serial, _ = rate(endpoint, sample_files, "serial", 1)
            parallel, uploaded = rate(endpoint, everything, "parallel", args.concurrency)
        assert uploaded == args.files
        print(f"one at a time {serial:.1f} files/s, concurrency {args.concurrency} {parallel:.1f} files/s: "
              f"x{parallel / serial:.1f}")


if __name__ == "__main__":
    main()
