"""What the pinned upstream charts do with a DaemonSet's placement, read at their tags.

Each entry renders, as its chart template does, the pod's ``nodeSelector`` and ``affinity``
from the values we pass merged over the chart's defaults (Helm's merge: maps merge key by
key, a list or scalar replaces the default, and a null would delete a key but CDK drops
nulls before Helm sees them). The facts were read in:

- NVIDIA k8s-device-plugin, tag v0.17.1: deployments/helm/nvidia-device-plugin/values.yaml
  (default ``affinity``: a required node affinity of three terms on NFD's
  ``feature.node.kubernetes.io/pci-10de.present``, ``feature.node.kubernetes.io/cpu-model.vendor_id``
  and ``nvidia.com/gpu.present``) and templates/daemonset-device-plugin.yml (``nodeSelector``
  and ``affinity`` copied from values).
- aws-neuron/neuron-helm-charts 1.1.2 (commit 1a1d41e): values.yaml (``devicePlugin.affinity``:
  instance type In ``neuronInstances`` and ``eks.amazonaws.com/compute-type`` NotIn fargate,
  hybrid, auto) and templates/_helpers.tpl (the instance-type key and list substituted).
- aws/eks-charts aws-efa-k8s-device-plugin chart v0.5.30 (commit bfe91c4): templates/daemonset.yaml
  (a required affinity per ``supportedInstanceLabels.keys``: instance type In the values list,
  and compute-type NotIn auto; ``nodeSelector`` from values) and values.yaml (the list).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

INSTANCE_TYPE = "node.kubernetes.io/instance-type"
COMPUTE_TYPE = "eks.amazonaws.com/compute-type"

NVIDIA_0_17_1_DEFAULT_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [
        {"matchExpressions": [{"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "In",
                               "values": ["true"]}]},
        {"matchExpressions": [{"key": "feature.node.kubernetes.io/cpu-model.vendor_id", "operator": "In",
                               "values": ["NVIDIA"]}]},
        {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]},
    ]}}}

NEURON_1_1_2_INSTANCES = [
    "trn1.2xlarge", "trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge", "trn2u.48xlarge", "inf1.xlarge",
    "inf1.2xlarge", "inf1.6xlarge", "inf1.24xlarge", "inf2.xlarge", "inf2.8xlarge", "inf2.24xlarge",
    "inf2.48xlarge", "ml.inf2.xlarge", "ml.inf2.8xlarge", "ml.inf2.24xlarge", "ml.inf2.48xlarge",
    "ml.trn1.2xlarge", "ml.trn1.32xlarge", "ml.trn1n.32xlarge",
]

# The accelerated types of our catalog that chart v0.5.30's supportedInstanceLabels.values lists
# (the list has about 200 types; these are the ones that matter here).
EFA_V0_5_30_INSTANCES = [
    "g5.12xlarge", "g5.48xlarge", "g6e.48xlarge", "p3dn.24xlarge", "p4d.24xlarge", "p4de.24xlarge",
    "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge", "trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge",
]


def helm_merge(defaults: Any, overrides: Any) -> Any:
    """Helm's coalescing of user values over chart defaults (nulls never arrive: CDK drops them)."""
    if isinstance(defaults, dict) and isinstance(overrides, dict):
        merged = copy.deepcopy(defaults)
        for key, value in overrides.items():
            merged[key] = helm_merge(defaults.get(key), value) if key in defaults else copy.deepcopy(value)
        return merged
    return copy.deepcopy(overrides)


def _nvidia(values: dict) -> tuple[dict, dict]:
    effective = helm_merge({"nodeSelector": {}, "affinity": NVIDIA_0_17_1_DEFAULT_AFFINITY}, values)
    return effective["nodeSelector"], effective["affinity"]


def _neuron(values: dict) -> tuple[dict, dict]:
    plugin = helm_merge({"nodeSelector": {}}, values.get("devicePlugin", {}))
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [
            {"key": INSTANCE_TYPE, "operator": "In", "values": NEURON_1_1_2_INSTANCES},
            {"key": COMPUTE_TYPE, "operator": "NotIn", "values": ["fargate", "hybrid", "auto"]},
        ]}]}}}
    return plugin["nodeSelector"], affinity


def _efa(values: dict) -> tuple[dict, dict]:
    effective = helm_merge({"nodeSelector": {}}, values)
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [
            {"key": INSTANCE_TYPE, "operator": "In", "values": EFA_V0_5_30_INSTANCES},
            {"key": COMPUTE_TYPE, "operator": "NotIn", "values": ["auto"]},
        ]}]}}}
    return effective["nodeSelector"], affinity


# (chart, version) -> renders (nodeSelector, affinity) from our values, as the template at that tag does.
PLACEMENT: dict[tuple[str, str], Callable[[dict], tuple[dict, dict]]] = {
    ("nvidia-device-plugin", "0.17.1"): _nvidia,
    ("neuron-helm-chart", "1.1.2"): _neuron,
    ("aws-efa-k8s-device-plugin", "v0.5.30"): _efa,
}


def _expression_matches(expression: dict, labels: dict[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return labels.get(key) not in values  # an absent label is not in the list
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise ValueError(f"operator {operator} not modelled")


def schedulable_on(node_selector: dict, affinity: dict, labels: dict[str, str]) -> bool:
    """Whether a pod with this selector and required node affinity may run on a node with ``labels``."""
    if any(labels.get(k) != v for k, v in node_selector.items()):
        return False
    required = (affinity or {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    return any(all(_expression_matches(e, labels) for e in term.get("matchExpressions", []))
               for term in required["nodeSelectorTerms"])
