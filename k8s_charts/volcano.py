"""Volcano's scheduler policy for gang jobs on node groups that scale from zero.

Volcano's default actions start with ``enqueue``: a job's PodGroup stays Pending, and its
pods are not even created, until the cluster's idle resources can hold the job's minimum.
A node group at zero has no idle GPUs, so the pods never appear, cluster-autoscaler never
sees demand, and the job waits forever. Without ``enqueue``, ``allocate`` moves the
PodGroup to Inqueue at once. The pods are created and stay Pending as Unschedulable (gang:
none binds until ``minAvailable`` of them fit), the autoscaler adds nodes, and the gang
starts together. The policy goes into the chart's ``custom.scheduler_config_override``.
"""

from __future__ import annotations

import yaml

SCHEDULER_ACTIONS = "allocate, backfill"
SCHEDULER_TIERS = [
    {"plugins": [{"name": "priority"}, {"name": "gang"}, {"name": "conformance"}]},
    {"plugins": [{"name": "drf"}, {"name": "predicates"}, {"name": "proportion"}, {"name": "nodeorder"},
                 {"name": "binpack"}]},
]


def scheduler_config() -> str:
    return yaml.safe_dump({"actions": SCHEDULER_ACTIONS, "tiers": SCHEDULER_TIERS}, sort_keys=False)


def helm_values(node_selector: dict[str, str]) -> dict:
    """Values for the pinned upstream Volcano chart (versions.volcano_chart), installed by the cluster stack.

    Every component runs on ``node_selector``'s nodes (``custom.default_ns``), and images are
    pulled only when missing: the chart's default ``Always`` (installer/helm/chart/volcano/
    values.yaml, v1.15.1) makes every restart of the admission server depend on Docker Hub.
    """
    return {
        "basic": {"image_pull_policy": "IfNotPresent"},
        "custom": {"scheduler_config_override": scheduler_config(), "default_ns": dict(node_selector)},
    }
