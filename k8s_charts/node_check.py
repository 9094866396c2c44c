"""The admission gate of accelerated nodes: a DaemonSet per accelerator that checks each new node.

Accelerated node groups register their nodes with ``contract.NODE_CHECK_TAINT``; the DaemonSet's
pod (``python -m training.node_check`` in the trainer image of that accelerator) tolerates it, checks
the node and removes the taint when every check passed (training/node_check).

Least privilege: the service account may change its own Node only, and there only this check's taint,
labels and annotation (k8s_charts/own_node.py). Events about a Node live in ``default`` (client-go
tools/record/event.go), where the account may only create them.

Its pods are privileged (the GPUs through the NVIDIA runtime, /dev/neuron*, /dev/kmsg, DCGM's
diagnostic), so they live in a namespace of their own whose Pod Security level allows it.
"""

from __future__ import annotations

import json

from cdk8s import Chart
from constructs import Construct

from config import PlatformConfig
from config.catalog import ACCELERATOR_LABEL, EFA_RESOURCE, NODE_ROLE_LABEL, ACCELERATED_ROLE
from k8s_charts.objects import checkov_skips, k8s_object
from k8s_charts.own_node import own_node_objects, own_node_policy, removes_taint
from k8s_charts.pods import PodTemplate, Toleration
from training.contract import (
    ACCELERATOR_TAINTS, NODE_CHECK_DCGM_LEVEL_ENV, NODE_CHECK_EXPECTED_ENV, NODE_CHECK_MODULE,
    NODE_CHECK_ON_FAILURE_ENV, NODE_CHECK_TAINT, NODE_FAILED_CHECK_LABEL, NODE_HEALTH_LABEL, NODE_NAME_ENV,
    SCALE_DOWN_DISABLED_ANNOTATION,
)

NODE_CHECK_NAMESPACE = "training-node-check"
NODE_CHECK_SERVICE_ACCOUNT = "node-check"
NODE_CHECK_NAME = "training-platform-node-check"  # the cluster-scoped objects
EVENTS_NAMESPACE = "default"
NODE_CHECK_POD_FIELDS = (
    "serviceAccountName", "automountServiceAccountToken", "priorityClassName", "securityContext",
    "terminationGracePeriodSeconds", "nodeSelector", "tolerations", "containers",
)
# Privileged and root by necessity (see the module docstring); checkov's findings, with their reasons.
PRIVILEGED_SKIPS = {
    "CKV_K8S_16": "the node check reads the GPUs and Neuron devices and runs DCGM's diagnostic",
    "CKV_K8S_20": "privileged: DCGM's diagnostic and the kernel log need it",
    "CKV_K8S_23": "DCGM's diagnostic runs as root",
    "CKV_K8S_40": "DCGM's diagnostic runs as root",
    "CKV_K8S_37": "privileged: capabilities are not dropped",
    "CKV_K8S_22": "the trainer image's tools write their own temporary files",
    "CKV_K8S_38": "the check patches its own Node through the API (a policy holds it to that node)",
    "CKV_K8S_43": "the trainer image is pinned by tag in the platform config",
    "CKV_K8S_8": "a one-shot check then an idle process: nothing for a probe to watch",
    "CKV_K8S_9": "a one-shot check then an idle process: nothing for a probe to watch",
    "CKV_K8S_28": "privileged: capabilities are not dropped",
    "CKV_K8S_31": "privileged: the seccomp profile does not apply",
    "CKV2_K8S_6": "the pod serves nothing and makes no connection a policy would limit",
    "CKV_K8S_11": "no CPU limit: a quota would stretch DCGM's diagnostic; the request reserves its share",
    "CKV_K8S_15": "the image is pinned; pulling Always would make every restart depend on the registry",
}
# Events about a Node are kept in default (see above): the account may create them there and nothing else.
EVENTS_SKIPS = {"CKV_K8S_21": "Kubernetes keeps the events of a Node in the default namespace"}


def expected_devices(config: PlatformConfig) -> dict[str, dict]:
    """What each node group's nodes must show, from the instance catalog (the check's environment)."""
    return {
        group.name: {
            "instance": group.instance.name, "accelerator": group.instance.accelerator.value,
            "devices": group.instance.accelerator_count, "device_resource": group.instance.accelerator_resource,
            "efa": group.instance.efa_interfaces if group.efa_enabled else 0, "efa_resource": EFA_RESOURCE,
        }
        for group in config.accelerated_node_groups
    }


def admission_policy() -> tuple[dict, dict]:
    """The policy and binding that hold the check to its own node: it may remove its taint, set its labels
    and the annotation that keeps a failed node out of scale-down, nothing else."""
    return own_node_policy(
        NODE_CHECK_NAME, "the node check", f"system:serviceaccount:{NODE_CHECK_NAMESPACE}:{NODE_CHECK_SERVICE_ACCOUNT}",
        taints=removes_taint(NODE_CHECK_TAINT), labels=(NODE_HEALTH_LABEL, NODE_FAILED_CHECK_LABEL),
        annotations=(SCALE_DOWN_DISABLED_ANNOTATION,))


class NodeCheckChart(Chart):
    """The node check's namespace, service account and its rights, the admission policy, the DaemonSets."""

    def __init__(self, scope: Construct, id: str, config: PlatformConfig):
        super().__init__(scope, id)
        check = config.cluster.node_check
        labels = {"app.kubernetes.io/part-of": "training-platform", "app.kubernetes.io/name": "node-check"}

        def metadata(name: str, namespace: str | None = None, **extra) -> dict:
            return {"name": name, **({"namespace": namespace} if namespace else {}), "labels": labels, **extra}

        namespace = k8s_object(self, "namespace", api_version="v1", kind="Namespace", metadata={
            **metadata(NODE_CHECK_NAMESPACE),
            "labels": {**labels, "pod-security.kubernetes.io/enforce": "privileged"}})
        account = k8s_object(self, "account", api_version="v1", kind="ServiceAccount",
                             metadata=metadata(NODE_CHECK_SERVICE_ACCOUNT, NODE_CHECK_NAMESPACE))
        account.add_dependency(namespace)
        subject = [{"kind": "ServiceAccount", "name": NODE_CHECK_SERVICE_ACCOUNT, "namespace": NODE_CHECK_NAMESPACE}]
        own_node_objects(self, NODE_CHECK_NAME, labels, subject, admission_policy())
        k8s_object(self, "event-role", api_version="rbac.authorization.k8s.io/v1", kind="Role",
                   metadata=metadata(NODE_CHECK_NAME, EVENTS_NAMESPACE, annotations=checkov_skips(EVENTS_SKIPS)),
                   rules=[{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}])
        k8s_object(self, "event-binding", api_version="rbac.authorization.k8s.io/v1", kind="RoleBinding",
                   metadata=metadata(NODE_CHECK_NAME, EVENTS_NAMESPACE, annotations=checkov_skips(EVENTS_SKIPS)),
                   subjects=subject,
                   roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NODE_CHECK_NAME})
        expected = json.dumps(expected_devices(config), sort_keys=True, separators=(",", ":"))
        for accelerator in sorted({g.instance.accelerator.value for g in config.accelerated_node_groups}):
            env = {NODE_CHECK_EXPECTED_ENV: expected, NODE_CHECK_ON_FAILURE_ENV: check.failed_nodes,
                   NODE_CHECK_DCGM_LEVEL_ENV: str(check.dcgm_level if accelerator == "nvidia" else 0)}
            if accelerator == "nvidia":
                env["NVIDIA_VISIBLE_DEVICES"] = "all"  # every GPU, without holding the nvidia.com/gpu jobs need
            pod = PodTemplate(
                fields=NODE_CHECK_POD_FIELDS,
                labels={**labels, ACCELERATOR_LABEL: accelerator},
                service_account=NODE_CHECK_SERVICE_ACCOUNT, automount_service_account_token=True,
                # Scheduled before anything else on a node that has room for it alone.
                priority_class_name="system-node-critical", termination_grace_period_seconds=10,
                security_context={"runAsUser": 0, "runAsGroup": 0},
                node_selector={NODE_ROLE_LABEL: ACCELERATED_ROLE, ACCELERATOR_LABEL: accelerator},
                tolerations=[Toleration(ACCELERATOR_TAINTS[accelerator]), Toleration(NODE_CHECK_TAINT)],
                containers=[{
                    "name": "node-check",
                    "image": check.images[accelerator],
                    "command": ["python", "-m", NODE_CHECK_MODULE],
                    "env": [{"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                            *({"name": key, "value": value} for key, value in env.items())],
                    "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                    "securityContext": {"privileged": True, "runAsUser": 0},
                }],
            )
            selector = {**labels, ACCELERATOR_LABEL: accelerator}
            daemon_set = k8s_object(
                self, f"daemonset-{accelerator}", api_version="apps/v1", kind="DaemonSet",
                metadata=metadata(f"node-check-{accelerator}", NODE_CHECK_NAMESPACE,
                                  annotations=checkov_skips(PRIVILEGED_SKIPS)),
                spec={"selector": {"matchLabels": selector}, "template": pod.to_dict(),
                      "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}}})
            daemon_set.add_dependency(account)
