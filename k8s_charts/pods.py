"""The one pod template every chart that runs pods builds on: Volcano tasks, batch Jobs, StatefulSets.

Containers and volumes stay in the Kubernetes shape (``kubectl explain pod.spec.containers``);
what a pod is around them (who it runs as, where it may run, what it tolerates) is typed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

LOST_NODE_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
# The pod annotation cluster-autoscaler honours: it never removes a node that runs such a pod
# for consolidation (a training pod on a half-used node would otherwise be evicted to pack nodes).
SAFE_TO_EVICT = {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}

# The order a pod spec's fields are written in, one per kind of workload. Kubernetes reads them
# in any order; each kind keeps the order its manifests have always had, so that rendering them
# through this template changes no manifest, and no string the cluster stack hands CloudFormation.
TRAINING_POD_FIELDS = (
    "restartPolicy", "serviceAccountName", "automountServiceAccountToken", "securityContext",
    "terminationGracePeriodSeconds", "nodeSelector", "tolerations", "initContainers", "containers", "volumes",
)
ONE_OFF_POD_FIELDS = (
    "restartPolicy", "serviceAccountName", "automountServiceAccountToken", "nodeSelector", "securityContext",
    "containers", "volumes",
)
MEMBER_POD_FIELDS = (
    "nodeSelector", "priorityClassName", "automountServiceAccountToken", "affinity", "topologySpreadConstraints",
    "tolerations", "securityContext", "containers", "volumes",
)


@dataclass(frozen=True)
class Toleration:
    """Lets the pod run on (NoSchedule) or stay on (NoExecute) a node with the taint ``key``."""

    key: str
    effect: str = "NoSchedule"
    operator: str = "Exists"
    toleration_seconds: int | None = None  # NoExecute: evicted after this long instead of never

    def to_dict(self) -> dict[str, Any]:
        toleration: dict[str, Any] = {"key": self.key, "operator": self.operator, "effect": self.effect}
        if self.toleration_seconds is not None:
            toleration["tolerationSeconds"] = self.toleration_seconds
        return toleration


def lost_node_tolerations(seconds: int) -> tuple[Toleration, ...]:
    """A pod on a node that stopped answering is evicted after ``seconds`` instead of Kubernetes' 300."""
    return tuple(Toleration(key, effect="NoExecute", toleration_seconds=seconds) for key in LOST_NODE_TAINTS)


@dataclass(frozen=True)
class PodTemplate:
    """A pod template: the metadata its pods get and their spec.

    ``fields`` is the order the spec is written in (``*_POD_FIELDS``); a field that is set and
    not in it is an error, never dropped. A field left ``None`` is left out; an empty sequence
    is written as an empty list.
    """

    containers: Sequence[Mapping[str, Any]]
    fields: Sequence[str]
    volumes: Sequence[Mapping[str, Any]] | None = None
    init_containers: Sequence[Mapping[str, Any]] | None = None
    labels: Mapping[str, str] | None = None
    annotations: Mapping[str, str] | None = None
    restart_policy: str | None = None
    service_account: str | None = None
    # No pod of the platform calls the Kubernetes API, so none gets a token.
    automount_service_account_token: bool = False
    security_context: Mapping[str, Any] | None = None
    termination_grace_period_seconds: int | None = None
    node_selector: Mapping[str, str] | None = None
    priority_class_name: str | None = None
    affinity: Mapping[str, Any] | None = None
    topology_spread_constraints: Sequence[Mapping[str, Any]] | None = None
    tolerations: Sequence[Toleration] | None = None

    def spec(self) -> dict[str, Any]:
        values = {
            "restartPolicy": self.restart_policy,
            "serviceAccountName": self.service_account,
            "automountServiceAccountToken": self.automount_service_account_token,
            "securityContext": _plain(self.security_context),
            "terminationGracePeriodSeconds": self.termination_grace_period_seconds,
            "nodeSelector": _plain(self.node_selector),
            "priorityClassName": self.priority_class_name,
            "affinity": _plain(self.affinity),
            "topologySpreadConstraints": _plain(self.topology_spread_constraints),
            "tolerations": None if self.tolerations is None else [t.to_dict() for t in self.tolerations],
            "initContainers": _plain(self.init_containers),
            "containers": _plain(self.containers),
            "volumes": _plain(self.volumes),
        }
        present = {field: value for field, value in values.items() if value is not None}
        unplaced = sorted(set(present) - set(self.fields))
        if unplaced:
            raise ValueError(f"pod template: {', '.join(unplaced)} set but not in its fields {list(self.fields)}")
        return {field: present[field] for field in self.fields if field in present}

    def to_dict(self) -> dict[str, Any]:
        metadata = {key: dict(value) for key, value in (("labels", self.labels), ("annotations", self.annotations))
                    if value is not None}
        return {**({"metadata": metadata} if metadata else {}), "spec": self.spec()}


def _plain(value: Any) -> Any:
    """Mappings and sequences as the dicts and lists a manifest is made of (a copy: templates are shared)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
