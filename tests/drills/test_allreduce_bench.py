"""allreduce-bench: a real two-process sweep on gloo, and the EFA check on NCCL's own log lines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from training.diagnostics.allreduce import TransportError, bus_bandwidth, check_efa, nccl_transport, sizes

# Timed, though nothing in it is a deadline: torchrun starts its two ranks in sessions of their own (torch 2.13
# torch/distributed/elastic/multiprocessing/subprocess_handler, start_new_session), which would leave the lowest
# priority's autogroup (tests/background.py) while the agent holding their store stayed in it.

# Shapes of the lines NCCL 2.2x and aws-ofi-nccl 1.x write at init with NCCL_DEBUG=INFO.
ON_EFA = """\
ip-10-0-1-5:79:79 [0] NCCL INFO Bootstrap : Using eth0:10.0.1.5<0>
ip-10-0-1-5:79:90 [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)
ip-10-0-1-5:79:90 [0] NCCL INFO Using network Libfabric
"""
ON_SOCKETS = """\
ip-10-0-1-5:79:79 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so
ip-10-0-1-5:79:90 [0] NCCL INFO Using network Socket
"""


def test_efa_is_recognised_from_the_nccl_log():
    assert nccl_transport(ON_EFA) == ("Libfabric", "efa")
    assert check_efa(ON_EFA) == "Libfabric / efa"


@pytest.mark.parametrize("log", [ON_SOCKETS, ON_EFA.replace("is efa", "is tcp"), ""])
def test_a_fallback_to_sockets_fails_loudly(log):
    with pytest.raises(TransportError):
        check_efa(log)


def test_bus_bandwidth_follows_the_nccl_tests_definition():
    assert bus_bandwidth(10.0, 8) == pytest.approx(17.5)
    assert sizes(8, 64) == [8, 16, 32, 64]


@pytest.mark.timeout(180)
def test_a_two_rank_sweep_prints_a_row_per_size(tmp_path):
    out = tmp_path / "sweep.json"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "training", "allreduce-bench", "--min-bytes=1024", "--max-bytes=1048576", "--iterations=3",
         "--warmup=1", f"--json={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=170, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = json.loads(out.read_text())
    assert table["world_size"] == 2 and table["transport"] == "gloo (TCP)"
    assert [row["bytes"] for row in table["rows"]] == [2**k for k in range(10, 21)]
    assert all(row["busbw_gbps"] == pytest.approx(row["algbw_gbps"], rel=0.01) for row in table["rows"])
    assert "busbw(GB/s)" in result.stdout


def test_require_efa_without_gpus_is_one_clear_error():
    result = subprocess.run([sys.executable, "-m", "training", "allreduce-bench", "--require-efa"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --require-efa needs GPUs (the nccl backend); this node has none"
