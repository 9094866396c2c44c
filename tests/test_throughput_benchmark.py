"""benchmarks/throughput.py confines its whole run to one accelerator's share of the host's CPUs.

The input pipeline's goal is stated for the CPUs a node gives each accelerator (12 per A100 on a
p4d); a benchmark machine with more would lend the loader's workers cores no training pod has.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARK = REPO / "benchmarks" / "throughput.py"
CPUS = len(os.sched_getaffinity(0))


@pytest.mark.skipif(CPUS < 2, reason="needs a CPU to leave out")
def test_what_the_run_starts_inherits_the_confinement():
    probe = (
        "import os, subprocess, sys; sys.path.insert(0, 'benchmarks'); import throughput; "
        "print(throughput.confine(1)); "
        "print(subprocess.run([sys.executable, '-c', 'import os; print(len(os.sched_getaffinity(0)))'], "
        "capture_output=True, text=True, check=True).stdout.strip())"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    words, child_cpus = done.stdout.splitlines()[-2:]
    assert words == f"confined to 1 of {CPUS} CPUs"
    assert child_cpus == "1"


def test_all_cpus_is_no_confinement():
    probe = "import sys; sys.path.insert(0, 'benchmarks'); import throughput; print(throughput.confine(None))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == f"{CPUS} CPUs", done.stderr


@pytest.mark.parametrize("cpus", [0, CPUS + 1])
def test_more_cpus_than_the_host_has_is_one_line(cpus):
    done = subprocess.run([sys.executable, str(BENCHMARK), f"--cpus={cpus}", "--sections=none"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip() == (f"--cpus: got {cpus}; allowed: 1 to {CPUS} (the CPUs this process may use)")
    assert done.stdout == ""
