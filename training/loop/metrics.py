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
    """Writes what rank 0 reports to stdout, a JSONL file and TensorBoard, as configured.

    stdout gets JSON lines, or with ``progress`` a line per report that people read (step/total,
    %, ETA, samples/s, loss) and a summary at the end; the JSONL file always gets JSON lines.
    """

    def __init__(self, enabled: bool, jsonl_path: str | None, tensorboard_dir: str | None, progress: bool = False):
        self.enabled = enabled
        self.progress = progress
        self.total_steps: int | None = None  # for % and ETA; set by the trainer once it knows its plan
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

    def evaluation(self, step: int, **fields: Any) -> None:
        """A validation's figures (training/loop/evaluate.py): an ``eval`` event, and TensorBoard's eval/*."""
        self.event("eval", step=step, **fields)
        if self._tensorboard is not None:
            for key, value in fields.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "epoch":
                    self._tensorboard.add_scalar(f"eval/{key}", value, step)

    def _emit(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = json.dumps(record, default=_plain)
        shown = human_line(record, self.total_steps) if self.progress else line
        with self._lock:
            if shown is not None:
                print(shown, file=sys.stdout, flush=True)
            if self._file is not None and not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None:
            with self._lock:
                self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def stdout_is_for_people(choice: str) -> bool:
    """metrics.stdout: progress, json, or auto (progress on a terminal)."""
    return choice == "progress" or (choice == "auto" and sys.stdout.isatty())


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def human_line(record: dict[str, Any], total_steps: int | None) -> str | None:
    """One event as a line for people, or None for events only machines need."""
    kind, r = record["event"], record
    if kind == "step":
        step = r["step"]
        parts = [f"step {step:,}" + (f"/{total_steps:,} {100 * step / total_steps:5.1f}%" if total_steps else "")]
        if total_steps and r.get("step_time_s"):
            parts.append(f"ETA {_duration(max(0, total_steps - step) * r['step_time_s'])}")
        parts.append(f"{r['samples_per_s']:,.0f} samples/s")
        parts.append(f"loss {r['loss']:.4f}")
        if r.get("data_wait_pct"):
            parts.append(f"data wait {r['data_wait_pct']:.0f}%")
        return "  ".join(parts)
    if kind == "rendezvous":
        return (f"{r['world_size']} worker(s) on {r.get('device', '?')}, global batch {r['global_batch']}"
                + (f", restart {r['restart_count']}" if r.get("restart_count") else ""))
    if kind == "start":
        return "starting from step 0"
    if kind == "resume":
        return f"resuming from step {r['step']:,}" + (f" ({r['checkpoint']})" if r.get("checkpoint") else "")
    if kind == "checkpoint_saved":
        return f"checkpoint saved: step {r['step']:,}, {r['bytes'] / 2**20:,.0f} MiB in {r['write_s']:.1f} s"
    if kind == "stop" and r.get("regroup"):
        return f"changing rounds at step {r['step']:,}: nodes came or went; the state stays in memory"
    if kind in ("finished", "stop"):
        how = "finished" if kind == "finished" else f"stopped ({r.get('signal') or 'a peer stopped'})"
        line = f"{how} at step {r['step']:,}"
        if r.get("elapsed_s") is not None:
            line += f" after {_duration(r['elapsed_s'])}"
        if r.get("samples_per_s"):
            line += f", {r['samples_per_s']:,.0f} samples/s on average"
        if r.get("loss") is not None:
            line += f", loss {r['loss']:.4f}"
        if r.get("checkpoint"):
            line += f"; newest checkpoint {r['checkpoint']}"
        if r.get("bad_samples"):
            line += f"; {r['bad_samples']} bad samples skipped"
        if r.get("eval"):
            line += f"; validation at step {r['eval']['step']:,}: {eval_figures(r['eval'])}"
        return line + ("; the same command resumes it" if kind == "stop" else "")
    if kind == "eval":
        return f"validation at step {r['step']:,}: {eval_figures(r)} ({r['samples']:,} samples, {r['eval_s']:.1f} s)"
    if kind == "checkpoint_started":
        return None
    rest = {k: v for k, v in r.items() if k not in ("event", "time")}
    return f"{kind}: {json.dumps(rest, default=_plain)}"


def eval_figures(r: dict[str, Any]) -> str:
    """An eval event's figures for people: top-1/top-5, or masked-LM accuracy, and the loss."""
    def percent(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.2f}%"

    if "mlm_accuracy" in r:
        shown = f"masked-LM accuracy {percent(r['mlm_accuracy'])}"
    else:
        shown = f"top-1 {percent(r.get('top1'))}, top-5 {percent(r.get('top5'))}"
    return shown + (f", loss {r['loss']:.4f}" if r.get("loss") is not None else "")


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    return str(value)
