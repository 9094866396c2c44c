"""The GPU acceptance check's cases that keep to its own session, on the CPU (test_gpu_check.py has the rest):
the Batch and Slurm commands (a static rendezvous: the store is in the launcher, the workers come from its
forkserver) and the bare loop (one process). benchmarks/gpu_check.py starts each in a process group, not a
session, so here they stay at the lowest priority with everything they wait on. Nothing here reads a clock:
a starved case is slower, not wrong (its waits are for a hung case: 900 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # benchmarks/ is no package: imported from its folder, after the path insert

pytestmark = [pytest.mark.untimed, pytest.mark.timeout(900)]


def run_check(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device=cpu", f"--out={tmp_path}", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=840)


def test_the_gpu_checks_batch_slurm_and_bare_loop_cases_run_on_the_cpu(tmp_path):
    done = run_check(tmp_path, "--cases=bare,slurm,batch")  # named in any order, run in the check's
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [c["name"] for c in report["cases"]] == ["Batch command", "Slurm command", "bare loop, eager"]
    assert all(c["ok"] for c in report["cases"])
    assert report["rates"]["bare_eager"] > 0
    table = (tmp_path / "gpu-check.md").read_text()
    assert "| bare loop, no process group |" in table
    assert "ratio" not in table  # a ratio needs the pod command and both bare loops in one run


def test_the_ratios_need_every_rate_of_their_mode():
    report = gpu_check.Report(rates={"launcher_eager": 90.0, "ddp_eager": 100.0, "bare_eager": 120.0,
                                     "launcher_compiled": 150.0, "ddp_compiled": None, "bare_compiled": 160.0})
    table = gpu_check.rates_table(report, gpu_check.CPU)
    assert "| ratio, eager: launcher / DDP loop, launcher / bare loop | 0.900 | 0.750 |" in table
    assert "ratio, compiled" not in table


def test_an_unknown_case_is_one_line_naming_the_allowed_ones(tmp_path):
    done = run_check(tmp_path, "--cases=pod,nccl")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "--cases: got 'pod,nccl'; allowed: a comma-separated list of lost-node, node-check, pod, batch, slurm, stop, "
        "program, bare-ddp, bare"]
    assert not (tmp_path / "gpu-check.json").exists()
