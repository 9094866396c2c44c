"""Upload a local dataset folder to the prefix the file system imports, resumably and in parallel.

Datasets are many small files (ImageNet: 1.33 M JPEGs of ~110 KB), so the time goes into
per-request latency, not bandwidth: uploads run ``concurrency`` files at a time, each small
file in one PUT, large ones in parts. Objects already there with the same size and ETag are
skipped, so a run that was interrupted, or that failed on some files, resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from trainctl.errors import UserError

CHUNK = 64 * 2**20  # multipart threshold and part size; the ETag of a resumed file is computed the same way
DEFAULT_CONCURRENCY = 64


@dataclass
class StageResult:
    uploaded: int = 0
    skipped: int = 0
    bytes_uploaded: int = 0
    failed: list[str] = field(default_factory=list)  # "<file>: <why>"


class _FileFailed(Exception):
    """One file that could not be uploaded; the others go on."""


def under_prefix(under: str) -> str:
    """``--under`` as a key prefix below the data prefix: ``imagenet`` and ``imagenet/`` both give
    ``imagenet/``; a path that leaves the data prefix (``..``) or is absolute is refused."""
    text = under.replace("\\", "/")
    parts = [p for p in PurePosixPath(text).parts if p not in ("", ".")]
    if text.startswith("/") or ".." in parts:
        raise UserError(f"--under: got {under!r}",
                        "allowed: a relative path below the data prefix, without '..', e.g. imagenet/train")
    return "".join(f"{part}/" for part in parts)


def local_etag(path: Path, chunk: int) -> str:
    """The ETag S3 gives an object uploaded with this part size: MD5, or MD5 of the parts' MD5s plus -N."""
    parts = []
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            parts.append(hashlib.md5(block, usedforsecurity=False).digest())
    if len(parts) <= 1:
        return (parts[0] if parts else hashlib.md5(b"", usedforsecurity=False).digest()).hex()
    return f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"


def existing_objects(s3, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
    found = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            found[obj["Key"]] = (obj["Size"], obj["ETag"].strip('"'))
    return found


def _bounded(pool: ThreadPoolExecutor, jobs: Iterator, limit: int, run) -> Iterator[Future]:
    """Submit ``run(job)`` for each job with at most ``limit`` in flight; yield each as it finishes."""
    pending: set[Future] = set()
    for job in jobs:
        if len(pending) >= limit:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            yield from done
        pending.add(pool.submit(run, job))
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        yield from done


def stage_data(source: Path, s3, bucket: str, prefix: str, progress=None,
               concurrency: int = DEFAULT_CONCURRENCY) -> StageResult:
    """Upload every file under ``source`` to ``s3://bucket/prefix/<relative path>``, ``concurrency``
    files at a time. Give ``s3`` a connection pool at least that large (botocore's default is 10)."""
    from boto3.s3.transfer import TransferConfig

    if not source.is_dir():
        raise UserError(f"{source} is not a directory", "pass the local folder that holds the dataset")
    files = sorted(p for p in source.rglob("*") if p.is_file())
    remote = existing_objects(s3, bucket, prefix)
    # Large files: parts in parallel within the file, on top of the files in parallel.
    large_file = TransferConfig(multipart_threshold=CHUNK, multipart_chunksize=CHUNK, max_concurrency=8)
    result = StageResult()
    lock = threading.Lock()
    total = sum(p.stat().st_size for p in files)
    bar = progress(total=total, unit="B", unit_scale=True, desc=f"s3://{bucket}/{prefix}") if progress else None

    def advance(size: int) -> None:
        if bar is not None:
            with lock:
                bar.update(size)

    def upload(path: Path) -> tuple[Path, int, bool]:
        try:
            return _upload(path)
        except Exception as exc:  # one file's failure must not stop the others; reported below
            raise _FileFailed(f"{path}: {type(exc).__name__}: {exc}") from exc

    def _upload(path: Path) -> tuple[Path, int, bool]:
        key = prefix + path.relative_to(source).as_posix()
        size = path.stat().st_size
        if key in remote and remote[key][0] == size and remote[key][1] == local_etag(path, CHUNK):
            advance(size)
            return path, size, False
        if size < CHUNK:
            with path.open("rb") as body:
                s3.put_object(Bucket=bucket, Key=key, Body=body)
            advance(size)
        else:
            s3.upload_file(str(path), bucket, key, Config=large_file, Callback=advance)
        return path, size, True

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="stage") as pool:
        for done in _bounded(pool, iter(files), 2 * concurrency, upload):
            try:
                path, size, uploaded = done.result()
            except _FileFailed as exc:
                result.failed.append(str(exc))
                continue
            if uploaded:
                result.uploaded += 1
                result.bytes_uploaded += size
            else:
                result.skipped += 1
            if bar is not None:
                bar.set_postfix(files=f"{result.uploaded + result.skipped}/{len(files)}", refresh=False)
    if bar is not None:
        bar.close()
    if result.failed:
        raise UserError(f"{len(result.failed)} of {len(files)} files were not uploaded (first: {result.failed[0]})",
                        "run the same command again: what is already there is skipped")
    return result
