"""A straggler named with its pod and its node replaced (issue 50, items 3 and 4): real agents and a real
etcd, one of whose nodes gets a fraction of its CPU time, as a noisy neighbour or a CPU quota leaves it,
and the loopback API server for the nodes. The watch's and the replacement's rules are in
test_straggler_watch.py; false alarms over ten minutes at 8 agents: benchmarks/stragglers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_trainctl_kube import FakeApiServer
from tests.trainctl_fixtures import kubeconfig
from training.contract import EXIT_REPLACE_NODE, STRAGGLER_TAINT
from tests.drill_harness import events, straggler_drill

pytestmark = pytest.mark.timeout(600)
# The drill trains about 500 steps (16,000 samples). An epoch of 2,000,000 outlasts it on any machine;
# the harness's default of 50,000,000 (the benchmark's ten minutes) cost every worker 6.8 s of
# torch.randperm (training/data/sampler.py: the epoch's order) at each start and regroup here.
STRAGGLER_SAMPLES = 2_000_000


def test_a_throttled_node_is_named_then_replaced_and_a_healthy_job_names_nobody(tmp_path):
    """Naming (item 3): four agents; after 8 s of healthy training the last node's workers get 15 % of
    their CPU time, and it is named with its pod. (Its own step time then stands 3.4 to 3.8 times the
    median on 2 busy cores, well over the drills' margin: at 25 % it stood 1.8 to 1.9 times, and one
    noisy window put the naming off; see STRAGGLER_DRILL_MARGIN.) Replacing (item 4,
    metrics.straggler_policy=replace): the named node taints itself on the API server and leaves; the
    others go on from memory at the step they had, and a fresh node joins. (One drill for both: each
    costs a minute of agents starting.)"""
    server = FakeApiServer()
    try:
        for name in ("n00", "n01", "n02", "n03", "n04"):
            server.nodes[f"node-{name}"] = {"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": f"node-{name}", "labels": {"training-platform/node-role": "accelerated"}},
                "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]}}
        config = kubeconfig(tmp_path / "kubeconfig", server.url)
        work = tmp_path / "job"
        # 8 s healthy: about four judged windows (a report every 1.6 s here), none of which may name anyone;
        # 12 s, seven windows, asserted nothing more.
        result = straggler_drill(work, agents=4, healthy_s=8, slowed_s=90, log_every_steps=20, share=0.15,
                                 kubeconfig=Path(config), after_s=0, samples=STRAGGLER_SAMPLES)
    finally:
        server.httpd.shutdown()
    notes = "\n".join(result.warnings)
    assert result.named_healthy == [], notes  # no false alarm while every node is healthy
    named = result.named_slowed
    assert named and named[0]["pod"] == result.slowed_pod, notes
    assert named[0]["times_median"] > 1.5 and named[0]["windows"] == 2
    # Named at the second report after the slowdown began, or the third when it began mid-window.
    windows = [(e["step"], e.get("slowest_pod"), round(e["rank_step_s"]["max"] / e["rank_step_s"]["median"], 2))
               for e in events(work, "step") if e["step"] > result.slowed_at_step and "rank_step_s" in e]
    assert result.windows_to_name <= 3, windows  # each window's slowest pod and its time over the median
    steps = [e for e in events(work, "step") if e["step"] >= named[0]["step"]]
    assert steps[0]["slowest_pod"] == result.slowed_pod and steps[0]["rank_step_s"]["max"] > steps[0]["rank_step_s"][
        "median"]
    replaced = result.replaced
    assert replaced["pod"] == result.slowed_pod == "n03", notes
    # Tainted, on its own node alone; the others are as they were.
    assert {"key": STRAGGLER_TAINT, "value": "true", "effect": "NoSchedule"} in server.nodes["node-n03"]["spec"]["taints"]
    assert all(STRAGGLER_TAINT not in json.dumps(server.nodes[f"node-n0{i}"]) for i in (0, 1, 2, 4))
    assert result.exit_codes["n03"] == EXIT_REPLACE_NODE
    # The survivors went on from memory at the step the node left: no step trained twice, no file read.
    assert result.steps_again == 0 and result.resume["step"] == replaced["step"], notes
    assert result.resume["checkpoint"] is None and result.resume["bytes_read"] == 0
    # The leaving node's stop checkpoint was written by all, at that step.
    assert [e for e in events(work, "checkpoint_started") if e["step"] == replaced["step"] and e["reason"] == "replace"]
    # The survivors trained on without it, before the fresh node came. How fast, against the healthy job
    # (the issue's >= 0.97), is a figure for a benchmark: a ratio of rates is no assertion on shared cores.
    assert result.without_rate and result.without_rate > 0
    # A fresh node took its place.
    assert result.back_to_full_s is not None
    # One replacement at a time: only the one.
    assert len(events(work, "straggler_replaced")) == 1
