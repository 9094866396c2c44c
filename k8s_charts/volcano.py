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

Network topology.

A job may ask to be placed within one network node of EC2's topology (``spec.networkTopology``,
:class:`NetworkTopology`). Volcano models the network as HyperNodes: tier 1 holds Nodes, each
tier above holds HyperNodes of the tier below, and a job's ``highestTierAllowed`` is the highest
tier its pods may span (staging/src/volcano.sh/apis/pkg/apis/batch/v1alpha1/job.go and
docs/user-guide/how_to_use_network_topology_aware_scheduling.md, v1.15.1). The HyperNodes come
from the node labels EKS sets (:func:`network_topology_discovery`, in the controller's
``custom.controller_config_override``), and the scheduler honours a job's topology only with the
``network-topology-aware`` plugin (:data:`SCHEDULER_TIERS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Sequence

import yaml
from constructs import Construct

from config.catalog import NETWORK_LAYERS
from k8s_charts.objects import k8s_object
from k8s_charts.pods import PodTemplate
from training.contract import network_node_label

JOB_API_VERSION = "batch.volcano.sh/v1alpha1"
HOSTNAME_LABEL = "kubernetes.io/hostname"

SCHEDULER_ACTIONS = "allocate, backfill"
# network-topology-aware, in the second tier after binpack as Volcano's guide configures it
# (docs/user-guide/how_to_use_network_topology_aware_scheduling.md, v1.15.1): without it a job's
# networkTopology is not enforced, the HyperNode search falls back to the whole cluster
# (pkg/scheduler/framework/session_plugins.go HyperNodeGradientForJobFn, v1.15.1). Its default
# arguments stay. They also score nodes for pods of jobs without a topology
# (pkg/scheduler/plugins/network-topology-aware/network_topology_aware.go batchNodeOrderFnForNormalPods,
# hypernode.binpack.normal-pod.enable, default true, v1.15.1): a node ranks higher the fuller its
# HyperNodes are (CPU and memory, tier 1 weighing most), and a node in no HyperNode ranks highest.
# Kept on: it is binpack one level up, the policy this tier already has. A job without a topology
# fills network nodes already in use, which keeps its own pods close and leaves empty network nodes
# whole for the jobs that ask for one. Among one job's candidate nodes (one instance type: the pod's
# nodeSelector) all or none carry the labels, unless a node's lookup failed at its start.
SCHEDULER_TIERS = [
    {"plugins": [{"name": "priority"}, {"name": "gang"}, {"name": "conformance"}]},
    {"plugins": [{"name": "drf"}, {"name": "predicates"}, {"name": "proportion"}, {"name": "nodeorder"},
                 {"name": "binpack"}, {"name": "network-topology-aware"}]},
]
# The name of the platform's topology in the controller's label discovery (at most 20 characters,
# pkg/controllers/hypernode/discovery/label/label.go networkTopologyTypeLength, v1.15.1); it is
# part of every discovered HyperNode's name, hypernode-eks-tier<N>-<random>.
TOPOLOGY_TYPE = "eks"


def scheduler_config() -> str:
    return yaml.safe_dump({"actions": SCHEDULER_ACTIONS, "tiers": SCHEDULER_TIERS}, sort_keys=False)


def topology_labels() -> list[str]:
    """The node labels of the platform's topology, top of the network first, as the discovery lists them.

    EKS labels a node topology.k8s.aws/network-node-layer-1 (the top) to -3 (the network node the
    instance hangs from) (training.contract.network_node_label). The label discovery makes tier 1
    of the second-to-last entry and walks up, dropping the last, which names the Nodes themselves
    (label.go parseCfg: ``for i := len(labels) - 2; i >= 0; i--``, v1.15.1). So: layer-3 is tier 1,
    layer-2 tier 2, layer-1 tier 3. A node that lacks a label is left out of that tier and every
    tier above it (label.go generateHyperNodeInfo), which is why every type of the catalog has
    either no layers or all NETWORK_LAYERS of them (tests/unit/test_catalog.py).
    """
    return [*(network_node_label(layer) for layer in range(1, NETWORK_LAYERS + 1)), HOSTNAME_LABEL]


def network_topology_discovery() -> dict[str, Any]:
    """The Volcano controller's config: HyperNodes discovered from the nodes' topology labels.

    The controller's hyperNode-controller runs by default and reads the key volcano-controller.conf
    of the chart's <release>-controller-configmap; it watches the ConfigMap and the nodes, so nodes
    that cluster-autoscaler adds join their HyperNodes without a restart (pkg/controllers/hypernode/
    config/loader.go, configmap_handler.go, discovery/label/label.go, v1.15.1). No ``interval``: the
    label source rebuilds on every node event (label.go AddNode, UpdateNode, DeleteNode).
    """
    labels = [{"nodeLabel": label} for label in topology_labels()]
    return {"networkTopologyDiscovery": [{"source": "label", "enabled": True,
                                          "config": {"networkTopologyTypes": {TOPOLOGY_TYPE: labels}}}]}


def helm_values(node_selector: dict[str, str]) -> dict:
    """Values for the pinned upstream Volcano chart (versions.volcano_chart), installed by the cluster stack.

    Every component runs on ``node_selector``'s nodes (``custom.default_ns``), and images are
    pulled only when missing: the chart's default ``Always`` (installer/helm/chart/volcano/
    values.yaml, v1.15.1) makes every restart of the admission server depend on Docker Hub.
    ``custom.controller_config_override`` is a mapping, not YAML text as the values.yaml comment
    shows: the chart writes ``toYaml`` of it under ``volcano-controller.conf: |``
    (templates/controllers.yaml, v1.15.1), and toYaml of a string is a quoted or ``|`` scalar, not
    the config the controller parses.
    """
    return {
        "basic": {"image_pull_policy": "IfNotPresent"},
        "custom": {"scheduler_config_override": scheduler_config(), "default_ns": dict(node_selector),
                   "controller_config_override": network_topology_discovery()},
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


class TopologyMode(str, Enum):
    """The Job CRD's spec.networkTopology.mode (v1.15.1)."""

    SOFT = "soft"
    HARD = "hard"


@dataclass(frozen=True)
class NetworkTopology:
    """A job's ``spec.networkTopology``: its pods within one HyperNode of tier ``highest_tier_allowed``
    or lower (hard), or as low a tier as fits (soft).

    Always with highestTierAllowed: in v1.15.1 a hard topology without it (or with a
    highestTierName that no HyperNode has) is no constraint at all (pkg/scheduler/api/job_info.go
    IsHardTopologyMode). Never with highestTierName: the job webhook refuses both together
    (pkg/webhooks/admission/jobs/validate/admit_job.go validateNetworkTopology). A soft topology's
    tier is overwritten by the whole cluster's in each session (pkg/scheduler/framework/session.go
    convertSoftToHardTopology, v1.15.1), so there it is no limit. The job webhook refuses any change
    of it on a job that exists (admit_job.go): a job is resubmitted to change it.
    """

    mode: TopologyMode
    highest_tier_allowed: int

    def __post_init__(self) -> None:
        if self.highest_tier_allowed < 1:  # tier 0 is no HyperNode's: a hard job would wait forever
            raise ValueError(f"a network topology's highest tier is 1 or more: {self}")

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "highestTierAllowed": self.highest_tier_allowed}


@dataclass(frozen=True)
class VolcanoJob:
    """A Volcano Job's spec: a gang of tasks in a queue, and what happens when its pods end.

    ``min_success``: the job has succeeded once this many pods have. ``max_retry``: the job fails
    once its retry count (every RestartPod and RestartJob adds one) reaches it. No plugins.
    ``network_topology``: where in the network its pods may sit (none: anywhere).
    """

    queue: str
    priority_class: str
    min_available: int
    max_retry: int
    ttl_seconds_after_finished: int
    tasks: Sequence[VolcanoTask]
    min_success: int | None = None
    policies: Sequence[LifecyclePolicy] | None = None
    network_topology: NetworkTopology | None = None

    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"schedulerName": "volcano", "queue": self.queue,
                                "priorityClassName": self.priority_class, "minAvailable": self.min_available}
        if self.min_success is not None:
            spec["minSuccess"] = self.min_success
        spec |= {"maxRetry": self.max_retry, "ttlSecondsAfterFinished": self.ttl_seconds_after_finished}
        if self.policies is not None:
            spec["policies"] = [policy.to_dict() for policy in self.policies]
        if self.network_topology is not None:
            spec["networkTopology"] = self.network_topology.to_dict()
        return {**spec, "tasks": [task.to_dict() for task in self.tasks]}

    def add_to(self, scope: Construct, id: str, metadata: Mapping[str, Any]) -> None:
        """The Job, named and labelled by ``metadata``, as an object of ``scope`` (a cdk8s chart)."""
        k8s_object(scope, id, api_version=JOB_API_VERSION, kind="Job", metadata=dict(metadata), spec=self.spec())
