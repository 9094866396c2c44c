"""The trainer talks to people in a terminal and to machines elsewhere (issue 17, item 7):
a progress line per report and a summary on a terminal, JSON lines otherwise; Ctrl-C
checkpoints, a second Ctrl-C exits; --help lists every key and --print-config the result."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import yaml

from tests.conftest import REPO
from training.loop.checkpoint import SLOW_WRITE_ENV
from training.config import TrainConfig, load_train_config

# Timed, not untimed: its one deadline, a second Ctrl-C's exit within 20 s against a stop that waits 60 s for its
# checkpoint write, needs the CPU at once, and `make test` runs the untimed drills at the lowest priority
# (tests/background.py), where a timed drill keeping both cores busy for 20 s would make it late.

PROGRESS = re.compile(r"^step (\d+)/(\d+) +(\d+\.\d)%  ETA \d+:\d\d:\d\d  [\d,]+ samples/s  loss \d+\.\d{4}")


def train_args(tmp_path, *extra: str, steps: int = 12) -> list[str]:
    return [sys.executable, "-m", "training", "train", "--model.name=mlp", "--model.image_size=16",
            "--model.num_classes=4", "--data.synthetic_samples=100000", "--data.num_workers=0",
            "--train.global_batch_size=16", "--train.micro_batch_size=16", f"--train.max_steps={steps}",
            "--train.log_every_steps=4", "--train.precision=fp32", "--train.device=cpu",
            f"--checkpoint.dir={tmp_path}/checkpoints", f"--metrics.jsonl_path={tmp_path}/metrics.jsonl", *extra]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def test_on_a_terminal_a_progress_line_per_report_and_a_summary(tmp_path):
    controller, terminal = pty.openpty()  # stdout is a terminal, as in a user's shell
    process = subprocess.Popen(train_args(tmp_path), cwd=REPO, stdout=terminal, stderr=subprocess.DEVNULL,
                               env=env())
    os.close(terminal)
    output = b""
    while True:
        ready, _, _ = select.select([controller], [], [], 120)
        try:
            chunk = os.read(controller, 4096) if ready else b""
        except OSError:  # the terminal closed with the process
            chunk = b""
        if not chunk:
            break
        output += chunk
    assert process.wait(timeout=120) == 0
    lines = output.decode().replace("\r\n", "\n").splitlines()
    progress = [PROGRESS.match(line) for line in lines if line.startswith("step ")]
    assert [(m.group(1), m.group(2), m.group(3)) for m in progress] == [
        ("4", "12", "33.3"), ("8", "12", "66.7"), ("12", "12", "100.0")]
    assert re.match(r"^finished at step 12 after 0:00:\d\d, [\d,]+ samples/s on average, loss \d+\.\d{4}; newest "
                    rf"checkpoint {tmp_path}/checkpoints/step-000000012.pt; validation at step 12: "
                    r"top-1 \d+\.\d\d%, top-5 \d+\.\d\d%, loss \d+\.\d{4}$", lines[-1]), lines[-1]
    assert re.match(r"^validation at step 12: top-1 \d+\.\d\d%, top-5 \d+\.\d\d%, loss \d+\.\d{4} "
                    r"\([\d,]+ samples, \d+\.\d s\)$", lines[-3]), lines[-3]
    assert not any(line.startswith("{") for line in lines)
    # The file keeps every record as JSON, for tools.
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "finished" and records[-1]["samples_per_s"] > 0


def test_elsewhere_json_lines(tmp_path):
    result = subprocess.run(train_args(tmp_path, steps=4), cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=env())
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["event"] for r in records][-1] == "finished"


def wait_for_step(process, tmp_path, at_least: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    path = tmp_path / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and any(json.loads(line).get("step", 0) >= at_least and json.loads(line)["event"] == "step"
                                 for line in path.read_text().splitlines()):
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError("no step")


def test_ctrl_c_checkpoints_and_stops_and_says_so(tmp_path):
    process = subprocess.Popen(train_args(tmp_path, "--metrics.stdout=progress", steps=100000), cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    wait_for_step(process, tmp_path, 4)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert "Ctrl-C: saving a checkpoint at the end of this step, then stopping (Ctrl-C again exits at once)" in err
    summary = out.splitlines()[-1]
    stopped_at = int(re.match(r"^stopped \(SIGINT\) at step (\d+) after", summary).group(1))
    assert summary.endswith("; the same command resumes it")
    assert (tmp_path / "checkpoints" / f"step-{stopped_at:09d}.pt").exists()


def test_a_second_ctrl_c_exits_at_once(tmp_path):
    # A checkpoint write that takes long (the fault injection of training.loop.checkpoint) keeps the
    # first Ctrl-C's stop busy; the second one must not wait for it.
    process = subprocess.Popen(train_args(tmp_path, steps=100000), cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True,
                               env={**env(), SLOW_WRITE_ENV: "60"})
    wait_for_step(process, tmp_path, 4)
    process.send_signal(signal.SIGINT)
    time.sleep(1)
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    code = process.wait(timeout=30)
    assert code == 128 + signal.SIGINT and time.monotonic() - started < 20  # the stop's write takes 60 s
    assert "second Ctrl-C: exiting now, without a checkpoint" in process.stderr.read()


def test_help_lists_every_key_with_its_default_and_print_config_shows_the_result(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "training", "train", "--help"], cwd=REPO, capture_output=True,
                               text=True, timeout=60, env=env()).stdout
    for section, model in TrainConfig.model_fields.items():
        for key in model.annotation.model_fields:
            assert f"  --{section}.{key}=" in help_text
    assert "  --optim.lr=0.1\n" in help_text and "--train.precision=auto  (auto | fp32 | bf16 | fp16)" in help_text
    printed = subprocess.run([sys.executable, "-m", "training", "train", "--print-config", "--optim.lr=0.3",
                              "--model.name=resnet18"], cwd=REPO, capture_output=True, text=True, timeout=60,
                             env=env())
    assert printed.returncode == 0 and not (tmp_path / "checkpoints").exists()
    shown = yaml.safe_load(printed.stdout)
    assert shown == load_train_config(None, ["--optim.lr=0.3", "--model.name=resnet18"]).model_dump(mode="json")
    assert shown["optim"]["lr"] == 0.3 and shown["checkpoint"]["dir"] == "/fsx/checkpoints/default"
