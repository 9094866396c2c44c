"""Checkpoints on the shared file system: atomic, durable when announced, last K kept, optionally async.

A checkpoint is one file ``step-<step>.pt`` in ``directory``. It is written under a unique
temporary name in ``staging_dir`` (same file system, outside the S3-linked tree, so a file being
written is never exported), flushed to disk, renamed into place, and the directory is synced.
Only then is it announced (``on_saved``). A crash at any point leaves either the old set of
checkpoints or the old set plus the new one: never a half-written file under a checkpoint name.

Files are read with ``torch.load(weights_only=True)``: a checkpoint holds tensors and plain
values only, so a file planted on the shared file system cannot run code in the trainer.
Which file to load is decided by one reader (rank 0, see ``training/loop/trainer.py``).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from training.contract import CHECKPOINT_NAME, checkpoint_name

log = logging.getLogger(__name__)
TEMPORARY_NAME = re.compile(r"^step-\d{9}\.pt\.[^/]+\.tmp$")
# A temporary file untouched this long belongs to a writer that died (a live writer keeps
# writing to it; the largest checkpoints take minutes, not an hour).
STALE_TEMPORARY_S = 3600
SET_ASIDE = "set-aside"
# Seconds between the tries of a read that fails with an I/O error (EIO, ESTALE, a timeout): such
# an error may pass (a file server failing over, a client reconnecting), and taking the file for a
# bad one would skip it, or with start_fresh set every checkpoint aside. One that persists is
# reported as an I/O error, and start_fresh refuses over it (training/loop/resume.py).
READ_RETRY_DELAYS_S = (0.5, 1.0, 2.0)
# Fault injection for tests: seconds each write sleeps before its rename (a slow file system).
SLOW_WRITE_ENV = "TRAINING_FAULT_SLOW_CHECKPOINT_WRITE_S"


class CheckpointError(Exception):
    """The checkpoint directory cannot be used as it is; the message is one line for the user."""


class HostCopies:
    """How a snapshot moves device tensors to the host: the CUDA calls, kept apart so that a test
    can stand in for the device (tests/unit/test_checkpoint.py)."""

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def empty_like(self, tensor: torch.Tensor, pin_memory: bool) -> torch.Tensor:
        # Same shape, dtype and strides (preserve_format), on the host, page-locked: torch.empty_like
        # (torch/_torch_docs.py and _C/_VariableFunctions.pyi, v2.13.0).
        return torch.empty_like(tensor, device="cpu", pin_memory=pin_memory)

    def copy_(self, destination: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
        destination.copy_(source, non_blocking=non_blocking)

    def record(self, device: torch.device) -> Any:
        """An event after every copy enqueued so far on ``device``'s current stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def synchronize(self, event: Any) -> None:
        event.synchronize()


class Snapshot:
    """A deep copy of a state with every tensor on the host; :meth:`ready` before reading it.

    A device tensor goes into a page-locked host buffer by a non-blocking copy, enqueued on the
    device's current stream: a copy to pageable memory would block the caller until the device
    had run everything queued before it, tensor by tensor, and then copy at pageable speed
    (``Tensor.copy_``: with ``non_blocking`` "the copy may occur asynchronously with respect to
    the host", torch/_tensor_docs.py v2.13.0; and a host tensor so filled must not be read before
    the copy is known to be done: the "good usage of non_blocking and pin_memory()" tutorial,
    pytorch.org/tutorials/intermediate/pinmem_nonblock.html, linked from ``Tensor.to``'s
    docstring in v2.13.0). The copy reads the tensor as it is at that point of the stream: the
    training steps enqueued after save() returns, and collectives (NCCL's stream waits for the
    current one), change it only after the copy has read it. One event per device, waited for
    by whoever reads the snapshot (the writer thread), says the copies are done. A host tensor
    is cloned at once (save() returns only after the clone). The device tensors are held until
    :meth:`ready`, so that none is freed and its memory reused while its copy is queued.
    """

    def __init__(self, state: Any, copies: HostCopies):
        self._copies = copies
        self._sources: list[torch.Tensor] = []
        devices: dict[torch.device, None] = {}
        self._state = self._copy(state, devices)
        self._events = [copies.record(device) for device in devices]

    def _copy(self, value: Any, devices: dict[torch.device, None]) -> Any:
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if not self._copies.on_device(value):
                return value.to("cpu", copy=True)  # a clone on the host; elsewhere a blocking copy
            buffer = self._copies.empty_like(value, pin_memory=True)
            self._copies.copy_(buffer, value, non_blocking=True)
            self._sources.append(value)
            devices[value.device] = None
            return buffer
        if isinstance(value, dict):
            return {k: self._copy(v, devices) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(v, devices) for v in value)
        return value

    def ready(self) -> Any:
        """The state, once every copy into it has completed."""
        for event in self._events:
            self._copies.synchronize(event)
        self._events, self._sources = [], []
        return self._state


@dataclass
class Saved:
    """A checkpoint that is on disk: what ``on_saved`` receives."""

    step: int
    path: Path
    bytes: int
    write_s: float  # from the start of the write (which first waits for the copies to the host) to the synced rename
    # How long the caller of save() was held up: cloning the host tensors and enqueueing the device
    # tensors' copies; synchronous, also waiting for those copies and the write.
    blocking_s: float


@dataclass
class Newest:
    """The outcome of looking for the newest readable checkpoint."""

    step: int | None = None
    state: dict[str, Any] | None = None
    path: Path | None = None
    bytes_read: int = 0
    unreadable: list[str] = field(default_factory=list)  # "step-…: reason", newest first
    # Of those, the files the file system failed to read (after READ_RETRY_DELAYS_S): they may be
    # fine, so starting afresh over them is refused.
    io_errors: list[str] = field(default_factory=list)


class CheckpointManager:
    """Writes and finds checkpoints in one directory; at most one write is in flight."""

    def __init__(self, directory: str | Path, keep_last: int = 3, async_save: bool = False,
                 staging_dir: str | Path | None = None, on_saved: Callable[[Saved], None] | None = None,
                 on_set_aside: Callable[[Path, list[str]], None] | None = None,
                 host_copies: HostCopies | None = None):
        self.directory = Path(directory)
        self.staging_dir = Path(staging_dir) if staging_dir else self.directory / ".staging"
        self.keep_last = keep_last
        self.async_save = async_save
        self.on_saved = on_saved
        # Told where unreadable files were moved and why ("step-…: reason"), by retention.
        self.on_set_aside = on_set_aside
        self.host_copies = host_copies or HostCopies()
        self.last_saved: Saved | None = None
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        # What is known of each file: step -> ((mtime, size), None if readable else the reason).
        self._verdicts: dict[int, tuple[tuple[int, int], str | None]] = {}

    # --- finding -------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = (CHECKPOINT_NAME.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, step: int) -> Path:
        return self.directory / checkpoint_name(step)

    def load_newest(self) -> Newest:
        """The newest readable checkpoint; each unreadable newer one is named in ``unreadable``."""
        result = Newest()
        for step in reversed(self.steps()):
            path = self.path(step)
            try:
                result.state = _load(path)
            except FileNotFoundError:
                continue  # removed since the listing (another writer's retention): not a bad file
            except Exception as exc:  # noqa: BLE001 - any unreadable file means: try the previous one
                reason = _why_unreadable(path, exc)
                self._remember(step, reason)
                result.unreadable.append(f"{path.name}: {reason}")
                if isinstance(exc, OSError):
                    result.io_errors.append(f"{path.name}: {reason}")
                log.warning("checkpoint %s is unreadable (%s); trying the previous one", path, reason)
                continue
            self._remember(step, None)
            result.step, result.path, result.bytes_read = step, path, path.stat().st_size
            return result
        return result

    # --- checking ------------------------------------------------------------------------

    def probe(self) -> None:
        """Check at startup what the first save would find out too late: the directories are usable.

        Creates both directories, writes and syncs a file in the staging directory and renames
        it into the checkpoint directory (the move every save makes), then removes it.
        """
        for name, directory in (("checkpoint.dir", self.directory), ("checkpoint.staging_dir", self.staging_dir)):
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CheckpointError(f"{name}: cannot create {directory} ({exc.strerror or exc}); allowed: a "
                                      "writable directory on the shared file system") from None
        probe = self.staging_dir / f".probe.{_unique()}"
        target = self.directory / f".probe.{_unique()}"
        try:
            with open(probe, "wb") as handle:
                handle.write(b"probe")
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise CheckpointError(f"checkpoint.staging_dir: cannot write to {self.staging_dir} "
                                  f"({exc.strerror or exc}); allowed: a writable directory") from None
        try:
            os.replace(probe, target)
        except OSError as exc:
            probe.unlink(missing_ok=True)
            raise CheckpointError(
                f"checkpoint.staging_dir: cannot move a file from {self.staging_dir} into {self.directory} "
                f"({exc.strerror or exc}); allowed: a directory on the same file system as checkpoint.dir") from None
        target.unlink(missing_ok=True)
        self._remove_stale_temporaries()

    def set_aside(self, steps: list[int] | None = None) -> Path:
        """Move the checkpoints of ``steps`` (all by default) into ``<dir>/set-aside/<UTC time>/``:
        kept, no longer loaded."""
        target = self.directory / SET_ASIDE / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target.mkdir(parents=True, exist_ok=True)
        for step in self.steps() if steps is None else steps:
            os.replace(self.path(step), target / checkpoint_name(step))
            self._verdicts.pop(step, None)
        _fsync_directory(self.directory)
        return target

    # --- saving --------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], asynchronous: bool | None = None) -> None:
        """Save ``state`` as ``step``. Asynchronous (``async_save`` unless told) starts the copy to host
        memory now (see Snapshot) and writes in the background; ``on_saved`` says when the file is
        durable. The file holds ``state`` as it is when save() is called, whatever the caller
        changes after it returns."""
        self.wait()
        started = time.perf_counter()
        host_state = Snapshot(state, self.host_copies)
        copy_s = time.perf_counter() - started
        if not (self.async_save if asynchronous is None else asynchronous):
            self._write(step, host_state, copy_s, synchronous=True)
            return
        # Not a daemon: an exiting trainer joins it (bounded, see wait()) instead of killing it mid-write.
        self._writer = threading.Thread(target=self._write_guarded, args=(step, host_state, copy_s),
                                        name=f"checkpoint-{step}")
        self._writer.start()

    @property
    def in_flight(self) -> bool:
        return self._writer is not None and self._writer.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background write (if any) is on disk; re-raise its error.

        With ``timeout``, give up after that many seconds and return False (the write goes on).
        """
        if self._writer is not None:
            self._writer.join(timeout)
            if self._writer.is_alive():
                return False
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return True

    def _write_guarded(self, step: int, state: Snapshot, copy_s: float) -> None:
        try:
            self._write(step, state, copy_s, synchronous=False)
        except BaseException as exc:  # noqa: BLE001 - surfaced by wait() in the training loop
            self._error = exc

    def _write(self, step: int, snapshot: Snapshot, copy_s: float = 0.0, synchronous: bool = True) -> None:
        started = time.perf_counter()
        state = snapshot.ready()  # the copies out of the device are done before anything reads them
        self.directory.mkdir(parents=True, exist_ok=True)
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        # Unique across pods and restarts: host and pid alone repeat on a shared file system.
        temporary = self.staging_dir / f"{final.name}.{_unique()}.tmp"
        try:
            with open(temporary, "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            delay = float(os.environ.get(SLOW_WRITE_ENV, "0"))
            if delay:
                time.sleep(delay)
            size = temporary.stat().st_size
            os.replace(temporary, final)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        _fsync_directory(self.directory)
        self._remember(step, None)  # written whole and synced: readable
        write_s = time.perf_counter() - started
        self.last_saved = Saved(step, final, size, write_s, copy_s + write_s if synchronous else copy_s)
        if self.on_saved is not None:
            self.on_saved(self.last_saved)
        self._prune()

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` readable checkpoints, remove older readable ones, and set
        unreadable ones aside (moved, reported): an unreadable file never counts toward
        ``keep_last``, so the newest readable checkpoint, the one just written, is never removed
        to keep a torn newer file. Each file is checked once (see _unreadable)."""
        kept, unreadable, surplus = 0, [], []
        for step in reversed(self.steps()):
            reason = self._unreadable(step)
            if reason is not None:
                unreadable.append((step, reason))
            elif kept < self.keep_last:
                kept += 1
            else:
                surplus.append(step)
        for step in surplus:
            self.path(step).unlink(missing_ok=True)
            self._verdicts.pop(step, None)
        if unreadable:
            where = self.set_aside([step for step, _ in unreadable])
            files = [f"{checkpoint_name(step)}: {reason}" for step, reason in unreadable]
            log.warning("moved %d unreadable checkpoint(s) to %s: %s", len(files), where, "; ".join(files))
            if self.on_set_aside is not None:
                self.on_set_aside(where, files)
        self._remove_stale_temporaries()

    def _unreadable(self, step: int) -> str | None:
        """Why the checkpoint of ``step`` cannot be read, or None. Known for a file this manager
        wrote or read; otherwise checked with the tensors memory-mapped, not read (torch.load
        mmap=True, torch/serialization.py v2.13.0): the zip directory and the pickled structure
        are read and checked as a full load checks them, which catches torn, truncated and
        overwritten files and ones that hold code."""
        path = self.path(step)
        try:
            stat = path.stat()
        except FileNotFoundError:
            return None  # gone since the listing
        known = self._verdicts.get(step)
        if known is not None and known[0] == (stat.st_mtime_ns, stat.st_size):
            return known[1]
        try:
            _load(path, mmap=True)
            reason = None
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - any failure to read makes it unreadable
            reason = _why_unreadable(path, exc)
        self._remember(step, reason)
        return reason

    def _remember(self, step: int, reason: str | None) -> None:
        try:
            stat = self.path(step).stat()
        except OSError:
            return
        self._verdicts[step] = ((stat.st_mtime_ns, stat.st_size), reason)

    def _remove_stale_temporaries(self) -> None:
        """Temporary files of writers that died mid-write, once nobody has touched them for an hour."""
        if not self.staging_dir.is_dir():
            return
        now = time.time()
        for stale in self.staging_dir.iterdir():
            try:
                if TEMPORARY_NAME.match(stale.name) and now - stale.stat().st_mtime > STALE_TEMPORARY_S:
                    stale.unlink()
            except FileNotFoundError:
                pass  # another writer cleaned it up first


def _load(path: Path, mmap: bool = False) -> Any:
    """``torch.load`` of a checkpoint (tensors and plain values only), trying again after an I/O
    error. torch.load opens a path with Python's ``open`` and its zip reader reads through that
    file object (torch/serialization.py v2.13.0, ``_open_file_like``, ``_open_zipfile_reader``),
    so a failed read anywhere in the load arrives as the file system's ``OSError`` (checked by
    failing each read of a load in turn); a torn or refused file raises RuntimeError or
    UnpicklingError instead, and is not tried again."""
    for delay in (*READ_RETRY_DELAYS_S, None):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if delay is None:
                raise
            log.warning("reading %s failed (%s); trying again in %.1f s", path, exc.strerror or exc, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _why_unreadable(path: Path, exc: Exception) -> str:
    """The reason in a few words (torch's own message for a refused file suggests loading it unsafely)."""
    if isinstance(exc, OSError):
        return f"cannot be read ({exc.strerror or exc}) after {len(READ_RETRY_DELAYS_S) + 1} tries"
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    if magic != b"PK\x03\x04":
        return "not a checkpoint file (torn, truncated or overwritten)"
    refused = re.search(r"WeightsUnpickler error: (Unsupported global: GLOBAL \S+)", str(exc))
    if refused:
        return f"refused: it holds code, not only tensors and plain values ({refused.group(1)})"
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def _unique() -> str:
    return f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:12]}"


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
