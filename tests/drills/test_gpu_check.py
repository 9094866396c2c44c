"""The GPU acceptance check (benchmarks/gpu_check.py) on the CPU: every case of it runs and passes here, so
the check is ready whenever a GPU is lent. What only a GPU shows (CUDA, NCCL, compile) is not shown here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

# Timed, though it asserts what each case observed, never how fast (its rates are reported; a ratio needs a GPU
# alone): its lost node's agents hold 1 s leases on an etcd it starts, and the agents start sessions of their own.
# `make test` runs the untimed drills at the lowest priority (tests/background.py), where the agents, in sessions
# of their own, would leave that priority's autogroup and the etcd would not: a starved etcd with live agents is a
# lost lease, not a lost node. Alone it takes 75 s wall and 49 core-seconds (one case at a time, mostly one
# process), and the untimed work runs beside it. Its waits (300 s a wait, 900 s a launched case) are for a hung
# case, where each takes seconds.
pytestmark = pytest.mark.timeout(900)


def test_every_case_of_the_gpu_check_runs_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device=cpu", f"--out={tmp_path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [c["name"] for c in report["cases"]] == [
        "lost node, from memory", "pod command, eager", "Batch command", "Slurm command", "stop (SIGTERM)",
        "resume from the stop checkpoint",
        "own program (FSDP2 + DCP)", "bare DDP loop under torchrun, eager", "bare loop, eager"]
    assert all(c["ok"] for c in report["cases"])
    assert all(report["rates"][key] > 0 for key in ("launcher_eager", "ddp_eager", "bare_eager"))
    table = (tmp_path / "gpu-check.md").read_text()
    assert "| ratio, eager: launcher / DDP loop, launcher / bare loop |" in table
    assert report["environment"]["launcher_surfaces"] == "all present"
