"""A straggler named with its pod (issue 50, item 3): real agents and a real etcd, one of whose nodes
gets a fraction of its CPU time, as a noisy neighbour or a CPU quota leaves it. The watch's rules
are in test_straggler_watch.py; false alarms over ten minutes at 8 agents: benchmarks/stragglers.py."""

from __future__ import annotations

import pytest

from training.devtools.drills import events, straggler_drill

pytestmark = pytest.mark.timeout(600)


def test_a_throttled_node_is_named_with_its_pod_and_a_healthy_job_names_nobody(tmp_path):
    # Four agents; after 15 s of healthy training the last node's workers get a quarter of their CPU time.
    result = straggler_drill(tmp_path, agents=4, healthy_s=15, slowed_s=12, log_every_steps=20, share=0.25)
    assert result.named_healthy == []  # no false alarm while every node is healthy
    named = result.named_slowed
    assert named and {e["pod"] for e in named} == {result.slowed_pod}, named
    assert named[0]["times_median"] > 1.5 and named[0]["windows"] == 2
    # Named at the second report after the slowdown began, or the third when it began mid-window.
    assert result.windows_to_name <= 3
    steps = [e for e in events(tmp_path, "step") if e["step"] >= named[0]["step"]]
    assert steps[0]["slowest_pod"] == result.slowed_pod and steps[0]["rank_step_s"]["max"] > steps[0]["rank_step_s"][
        "median"]
