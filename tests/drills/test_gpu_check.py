"""The GPU acceptance check (benchmarks/gpu_check.py) on the CPU: every case of it runs and passes here, so
the check is ready whenever a GPU is lent. What only a GPU shows (CUDA, NCCL, compile) is not shown here.
This module runs the cases whose processes start sessions of their own; test_gpu_check_static.py the rest."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

# Timed, though it asserts what each case observed, never how fast (its rates are reported; a ratio needs a GPU
# alone): its lost node's agents hold 1 s leases on an etcd it starts, and the agents start sessions of their own,
# as torchrun's ranks do (torch 2.13 torch/distributed/elastic/multiprocessing/subprocess_handler/
# subprocess_handler.py: start_new_session). `make test` runs the untimed drills at the lowest priority
# (tests/background.py), where those processes, in sessions of their own, would leave that priority's autogroup
# and the etcd or store they wait on would not: a starved etcd with live agents is a lost lease, not a lost node.
# The cases that keep to the check's own session (the Batch and Slurm commands, the bare loop) are untimed, in
# test_gpu_check_static.py. Alone this takes about 45 s wall, one case at a time, and the untimed work runs
# beside it. Its waits (300 s a wait, 900 s a launched case) are for a hung case, where each takes seconds.
pytestmark = pytest.mark.timeout(900)

CASES = "lost-node,pod,stop,program,bare-ddp"


def test_the_gpu_checks_cases_on_the_platforms_rendezvous_and_under_torchrun_run_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device=cpu", f"--out={tmp_path}",
                           f"--cases={CASES}"], cwd=REPO, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [c["name"] for c in report["cases"]] == [
        "lost node, from memory", "pod command, eager", "stop (SIGTERM)", "resume from the stop checkpoint",
        "own program (FSDP2 + DCP)", "bare DDP loop under torchrun, eager"]
    assert all(c["ok"] for c in report["cases"])
    assert all(report["rates"][key] > 0 for key in ("launcher_eager", "ddp_eager"))
    assert report["environment"]["launcher_surfaces"] == "all present"
