"""Metrics from rank 0: one JSON line per logging interval, optionally TensorBoard events, and MFU."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)


def training_flops_per_sample(step_fn: Callable[[], None], samples: int) -> float | None:
    """FLOPs of one forward+backward per sample, counted by torch's FlopCounterMode on a real step."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        counter = FlopCounterMode(display=False)
        with counter:
            step_fn()
        return counter.get_total_flops() / samples
    except Exception as exc:  # noqa: BLE001 - MFU is optional; training is not
        log.warning("could not count FLOPs (%s); mfu will be null", exc)
        return None


class MetricsWriter:
    """Writes what rank 0 reports to stdout (JSON lines), a JSONL file and TensorBoard, as configured."""

    def __init__(self, enabled: bool, jsonl_path: str | None, tensorboard_dir: str | None):
        self.enabled = enabled
        self._file = None
        self._tensorboard = None
        self._lock = threading.Lock()  # the checkpoint writer thread reports too
        if not enabled:
            return
        if jsonl_path:
            Path(jsonl_path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(jsonl_path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(tensorboard_dir)

    def event(self, kind: str, **fields: Any) -> None:
        """A rendezvous, resume, checkpoint or stop: one JSON line, also readable by people."""
        self._emit({"event": kind, "time": round(time.time(), 3), **fields})

    def step(self, **fields: Any) -> None:
        self._emit({"event": "step", "time": round(time.time(), 3), **fields})
        if self._tensorboard is not None:
            for key, value in fields.items():
                if isinstance(value, (int, float)) and key != "step" and value is not None:
                    self._tensorboard.add_scalar(f"train/{key}", value, fields["step"])

    def _emit(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = json.dumps(record, default=_plain)
        with self._lock:
            print(line, file=sys.stdout, flush=True)
            if self._file is not None and not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None:
            with self._lock:
                self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    return str(value)
