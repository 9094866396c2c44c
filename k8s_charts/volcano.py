"""Volcano: the scheduler policy for gang jobs on node groups that scale from zero, and the Job.

The Job (``batch.volcano.sh/v1alpha1``, /work/shared/crds/volcano-v1.15.1 has its schema) is
typed: :class:`VolcanoJob` of :class:`VolcanoTask` s, each with the shared pod template
(k8s_charts/pods.py), and its :class:`LifecyclePolicy` s.

Scheduler policy.

Volcano's default actions start with ``enqueue``: a job's PodGroup stays Pending, and its
pods are not even created, until the cluster's idle resources can hold the job's minimum.
A node group at zero has no idle GPUs, so the pods never appear, cluster-autoscaler never
sees demand, and the job waits forever. Without ``enqueue``, ``allocate`` moves the
PodGroup to Inqueue at once. The pods are created and stay Pending as Unschedulable (gang:
none binds until ``minAvailable`` of them fit), the autoscaler adds nodes, and the gang
starts together. The policy goes into the chart's ``custom.scheduler_config_override``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Sequence

import yaml
from constructs import Construct

from k8s_charts.objects import k8s_object
from k8s_charts.pods import PodTemplate

JOB_API_VERSION = "batch.volcano.sh/v1alpha1"

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


class Action(str, Enum):
    """What the job controller does when a policy matches (the ones the platform's jobs use)."""

    TERMINATE_JOB = "TerminateJob"
    RESTART_JOB = "RestartJob"
    RESTART_POD = "RestartPod"
    RESUME_JOB = "ResumeJob"


class Event(str, Enum):
    """A pod event a policy can match (the Job CRD's policies[].event enum, v1.15.1; those the platform uses)."""

    POD_FAILED = "PodFailed"
    POD_EVICTED = "PodEvicted"


@dataclass(frozen=True)
class LifecyclePolicy:
    """One of a job's policies: on ``exit_code`` (the first container's), or on one or more events."""

    action: Action
    exit_code: int | None = None
    events: Sequence[Event] = ()

    def __post_init__(self) -> None:
        if (self.exit_code is None) == (not self.events):
            raise ValueError(f"a Volcano policy matches an exit code or events, not both or neither: {self}")

    def to_dict(self) -> dict[str, Any]:
        if self.exit_code is not None:
            match: dict[str, Any] = {"exitCode": self.exit_code}
        elif len(self.events) == 1:
            match = {"event": self.events[0].value}
        else:
            match = {"events": [event.value for event in self.events]}
        return {**match, "action": self.action.value}


@dataclass(frozen=True)
class VolcanoTask:
    """``replicas`` pods of one template; the job starts once ``min_available`` of them can."""

    name: str
    replicas: int
    template: PodTemplate
    min_available: int | None = None

    def to_dict(self) -> dict[str, Any]:
        task: dict[str, Any] = {"name": self.name, "replicas": self.replicas}
        if self.min_available is not None:
            task["minAvailable"] = self.min_available
        return {**task, "template": self.template.to_dict()}


@dataclass(frozen=True)
class VolcanoJob:
    """A Volcano Job's spec: a gang of tasks in a queue, and what happens when its pods end.

    ``min_success``: the job has succeeded once this many pods have. ``max_retry``: the job fails
    once its retry count (every RestartPod and RestartJob adds one) reaches it. No plugins.
    """

    queue: str
    priority_class: str
    min_available: int
    max_retry: int
    ttl_seconds_after_finished: int
    tasks: Sequence[VolcanoTask]
    min_success: int | None = None
    policies: Sequence[LifecyclePolicy] | None = None

    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"schedulerName": "volcano", "queue": self.queue,
                                "priorityClassName": self.priority_class, "minAvailable": self.min_available}
        if self.min_success is not None:
            spec["minSuccess"] = self.min_success
        spec |= {"maxRetry": self.max_retry, "ttlSecondsAfterFinished": self.ttl_seconds_after_finished}
        if self.policies is not None:
            spec["policies"] = [policy.to_dict() for policy in self.policies]
        return {**spec, "tasks": [task.to_dict() for task in self.tasks]}

    def add_to(self, scope: Construct, id: str, metadata: Mapping[str, Any]) -> None:
        """The Job, named and labelled by ``metadata``, as an object of ``scope`` (a cdk8s chart)."""
        k8s_object(scope, id, api_version=JOB_API_VERSION, kind="Job", metadata=dict(metadata), spec=self.spec())
