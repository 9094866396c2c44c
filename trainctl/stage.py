"""Upload a local dataset folder to the prefix the file system imports, resumably and in parallel."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

CHUNK = 64 * 2**20  # multipart threshold and part size; the ETag of a resumed file is computed the same way


@dataclass
class StageResult:
    uploaded: int = 0
    skipped: int = 0
    bytes_uploaded: int = 0


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


def stage_data(source: Path, s3, bucket: str, prefix: str, progress=None, workers: int = 16) -> StageResult:
    """Upload every file under ``source`` to ``s3://bucket/prefix/<relative path>``.

    Objects already there with the same size and ETag are skipped, so an interrupted run resumes.
    """
    from boto3.s3.transfer import TransferConfig

    if not source.is_dir():
        from trainctl.errors import UserError

        raise UserError(f"{source} is not a directory", "pass the local folder that holds the dataset")
    files = sorted(p for p in source.rglob("*") if p.is_file())
    remote = existing_objects(s3, bucket, prefix)
    config = TransferConfig(multipart_threshold=CHUNK, multipart_chunksize=CHUNK, max_concurrency=workers)
    result = StageResult()
    total = sum(p.stat().st_size for p in files)
    bar = progress(total=total, unit="B", unit_scale=True, desc=f"s3://{bucket}/{prefix}") if progress else None
    for path in files:
        key = prefix + path.relative_to(source).as_posix()
        size = path.stat().st_size
        if key in remote and remote[key] == (size, local_etag(path, CHUNK)):
            result.skipped += 1
            if bar is not None:
                bar.update(size)
                bar.set_postfix(files=f"{result.uploaded + result.skipped}/{len(files)}", refresh=False)
            continue
        s3.upload_file(str(path), bucket, key, Config=config, Callback=bar.update if bar is not None else None)
        result.uploaded += 1
        result.bytes_uploaded += size
        if bar is not None:
            bar.set_postfix(files=f"{result.uploaded + result.skipped}/{len(files)}", refresh=False)
    if bar is not None:
        bar.close()
    return result
