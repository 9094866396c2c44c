"""benchmarks/throughput.py confines its whole run to one accelerator's share of the host's CPUs.

The input pipeline's goal is stated for the CPUs a node gives each accelerator (12 vCPUs per A100
on a p4d, 24 per H100 on a p5); a benchmark machine with more would lend the loader's workers
cores no training pod has. A vCPU is one of a core's two threads, so the share is whole cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARK = REPO / "benchmarks" / "throughput.py"
CPUS = len(os.sched_getaffinity(0))

sys.path.insert(0, str(BENCHMARK.parent))
import throughput  # noqa: E402 - benchmarks/ is no package: imported from its folder, after the path insert

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = pytest.mark.untimed


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
    assert words == f"confined to 1 of {CPUS} CPUs (1 core × 1 thread)"
    assert child_cpus == "1"


def test_all_cpus_is_no_confinement():
    probe = "import sys; sys.path.insert(0, 'benchmarks'); import throughput; print(throughput.confine(None))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1].startswith(f"{CPUS} CPUs ("), done.stderr


@pytest.mark.parametrize("cpus", [0, CPUS + 1])
def test_more_cpus_than_the_host_has_is_one_line(cpus):
    done = subprocess.run([sys.executable, str(BENCHMARK), f"--cpus={cpus}", "--sections=none"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip() == (f"--cpus: got {cpus}; allowed: 1 to {CPUS} (the CPUs this process may use)")
    assert done.stdout == ""


# Two threads per core, numbered as Linux numbers them on EC2: CPU n and n + 8 share core n.
def two_threads_per_core(cpu: int) -> set[int]:
    return {cpu % 8, cpu % 8 + 8}


def one_thread_per_core(cpu: int) -> set[int]:
    return {cpu}


def test_the_kernels_cpu_lists_are_read():
    assert throughput.parse_cpu_list("0-2,8,10-11\n") == {0, 1, 2, 8, 10, 11}
    # And this host's own topology names every CPU among its core's threads.
    for cpu in os.sched_getaffinity(0):
        assert cpu in throughput.smt_siblings(cpu)


def test_a_share_is_whole_cores_where_cores_have_two_threads():
    picked = throughput.pick_cpus(list(range(16)), 12, two_threads_per_core)
    assert picked == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]  # not CPUs 0-11: 8 cores' worth
    assert throughput.layout(picked, two_threads_per_core) == "6 cores × 2 threads"


def test_an_odd_share_takes_one_thread_of_one_more_core():
    picked = throughput.pick_cpus(list(range(16)), 7, two_threads_per_core)
    assert picked == [0, 1, 2, 3, 8, 9, 10]
    assert throughput.layout(picked, two_threads_per_core) == "7 threads on 4 cores"


def test_without_smt_the_lowest_numbered_cpus():
    picked = throughput.pick_cpus(list(range(16)), 12, one_thread_per_core)
    assert picked == list(range(12))
    assert throughput.layout(picked, one_thread_per_core) == "12 cores × 1 thread"


@pytest.mark.parametrize(("gpu", "node", "vcpus", "cores"), [
    ("NVIDIA A100-SXM4-40GB", "p4d.24xlarge", 12, 6),
    ("NVIDIA H100 80GB HBM3", "p5.48xlarge", 24, 12),
    ("Tesla V100-SXM2-32GB", "p3dn.24xlarge", 12, 6),   # the 8-GPU node, not the 4-GPU p3.8xlarge
    ("NVIDIA RTX PRO 6000", "p4d.24xlarge", 12, 6),     # not in the catalog: the smallest share
])
def test_the_share_follows_the_gpu(gpu, node, vcpus, cores):
    chosen = throughput.node_type_for(gpu)
    assert chosen.name == node
    assert throughput.share_of(chosen, list(range(48)), two_threads_per_core)[0] == vcpus
    count, words = throughput.share_of(chosen, list(range(48)), one_thread_per_core)
    assert count == cores
    assert words.endswith(f"so the run has {cores} cores without their second threads (a lower bound)")


def test_a_host_smaller_than_the_share_gives_what_it_has():
    assert throughput.share_of(throughput.node_type_for("NVIDIA H100 80GB HBM3"), list(range(16)),
                               two_threads_per_core)[0] == 16


def test_the_run_is_confined_to_whole_cores(monkeypatch):
    confined_to = []
    monkeypatch.setattr(throughput, "smt_siblings", two_threads_per_core)
    monkeypatch.setattr(throughput.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(throughput.os, "sched_setaffinity", lambda pid, cpus: confined_to.append(sorted(cpus)))
    monkeypatch.setattr(throughput.torch, "set_num_threads", lambda n: None)
    assert throughput.confine(12) == "confined to 12 of 16 CPUs (6 cores × 2 threads)"
    assert confined_to == [[0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]]
