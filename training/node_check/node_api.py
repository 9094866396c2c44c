"""What the node check changes: its own Node object, an Event, and (when asked) its own instance; and
the straggler taint a node's own trainer puts on it (training/loop/replacement.py).

Each change to the Node is a JSON patch (RFC 6902) whose ``test`` operations hold the taint list
as it was read: ``spec.taints`` has no merge key, so a merge patch would replace the whole list
and could drop a taint another controller added meanwhile; the API server refuses a failed test
with 422, and the change is made again on a fresh read. The service account may patch nodes, but
the platform's ValidatingAdmissionPolicy (k8s_charts/node_check.py) lets it change only the Node its
pod runs on (the pod-bound token's node-name), and only this check's taint, labels and annotation.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from training.contract import (
    NODE_CHECK_TAINT, NODE_FAILED, NODE_FAILED_CHECK_LABEL, NODE_HEALTH_LABEL, NODE_PASSED,
    SCALE_DOWN_DISABLED_ANNOTATION as SCALE_DOWN_DISABLED,
)

EVENT_NAMESPACE = "default"  # where Kubernetes keeps the events of cluster-scoped objects (client-go's recorder)
COMPONENT = "node-check"
PATCH_ATTEMPTS = 5


def _pointer(key: str) -> str:
    """A map key as a JSON pointer segment (RFC 6901: ~ is ~0, / is ~1)."""
    return key.replace("~", "~0").replace("/", "~1")


def check_taint_index(node: dict) -> int | None:
    for index, taint in enumerate((node.get("spec") or {}).get("taints") or []):
        if taint.get("key") == NODE_CHECK_TAINT:
            return index
    return None


def verdict_patch(node: dict, passed: bool, failed_check: str | None, keep: bool) -> list[dict[str, Any]]:
    """The JSON patch that records a verdict on ``node`` as read: labels, and on a pass the taint removed."""
    metadata = node.get("metadata") or {}
    labels = metadata.get("labels") or {}
    taints = (node.get("spec") or {}).get("taints") or []
    patch: list[dict[str, Any]] = [{"op": "test", "path": "/spec/taints", "value": taints}] if taints else []
    if not labels:
        patch.append({"op": "add", "path": "/metadata/labels", "value": {}})
    patch.append({"op": "add", "path": f"/metadata/labels/{_pointer(NODE_HEALTH_LABEL)}",
                  "value": NODE_PASSED if passed else NODE_FAILED})
    if failed_check:
        patch.append({"op": "add", "path": f"/metadata/labels/{_pointer(NODE_FAILED_CHECK_LABEL)}",
                      "value": failed_check})
    elif NODE_FAILED_CHECK_LABEL in labels:
        patch.append({"op": "remove", "path": f"/metadata/labels/{_pointer(NODE_FAILED_CHECK_LABEL)}"})
    annotations = metadata.get("annotations") or {}
    if not passed and keep and annotations.get(SCALE_DOWN_DISABLED) != "true":
        if not annotations:
            patch.append({"op": "add", "path": "/metadata/annotations", "value": {}})
        patch.append({"op": "add", "path": f"/metadata/annotations/{_pointer(SCALE_DOWN_DISABLED)}", "value": "true"})
    index = check_taint_index(node)
    if passed and index is not None:
        patch.append({"op": "remove", "path": f"/spec/taints/{index}"})
    return patch


def taint_patch(node: dict, taint: dict[str, str]) -> list[dict[str, Any]] | None:
    """The JSON patch that adds ``taint`` to ``node`` as read; None when a taint of its key is there."""
    taints = (node.get("spec") or {}).get("taints") or []
    if any(existing.get("key") == taint["key"] for existing in taints):
        return None
    if not taints:
        return [{"op": "add", "path": "/spec/taints", "value": [taint]}]
    return [{"op": "test", "path": "/spec/taints", "value": taints}, {"op": "add", "path": "/spec/taints/-", "value": taint}]


def instance_id(node: dict) -> str | None:
    """``aws:///us-west-2a/i-0123456789abcdef0`` (the node's spec.providerID on EC2) -> the instance id."""
    provider = (node.get("spec") or {}).get("providerID") or ""
    last = provider.rsplit("/", 1)[-1]
    return last if provider.startswith("aws://") and last.startswith("i-") else None


class NodeApi:
    """The Kubernetes API, as the check's service account (in a pod) or a kubeconfig's context (tests)."""

    def __init__(self, core: Any) -> None:
        self._core = core

    @classmethod
    def connect(cls) -> "NodeApi":
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.CoreV1Api())

    def node(self, name: str) -> dict:
        return self._core.api_client.sanitize_for_serialization(self._core.read_node(name))

    def record(self, name: str, passed: bool, failed_check: str | None, keep: bool) -> None:
        """Patch the verdict onto node ``name``."""
        self._patch_fresh(name, lambda node: verdict_patch(node, passed, failed_check, keep))

    def add_taint(self, name: str, key: str, value: str, effect: str) -> bool:
        """Add a taint to node ``name`` unless one of ``key`` is there; False when it was."""
        return self._patch_fresh(name, lambda node: taint_patch(node, {"key": key, "value": value, "effect": effect}))

    def _patch_fresh(self, name: str, patch_for: Callable[[dict], list[dict[str, Any]] | None]) -> bool:
        """Apply ``patch_for(node as read)`` (None: nothing to change), again on a fresh read while the node
        changed in between (the patch's test failed: 422, or a conflict: 409). Whether it patched."""
        from kubernetes.client.exceptions import ApiException

        for attempt in range(PATCH_ATTEMPTS):
            patch = patch_for(self.node(name))
            if patch is None:
                return False
            try:
                self._core.patch_node(name, patch)
                return True
            except ApiException as error:
                if error.status not in (409, 422) or attempt == PATCH_ATTEMPTS - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def event(self, node: dict, reason: str, message: str, warning: bool) -> None:
        from kubernetes import client

        metadata = node.get("metadata") or {}
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._core.create_namespaced_event(EVENT_NAMESPACE, client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{metadata.get('name')}.node-check-"),
            involved_object=client.V1ObjectReference(kind="Node", api_version="v1", name=metadata.get("name"),
                                                     uid=metadata.get("uid")),
            reason=reason, message=message[:1024], type="Warning" if warning else "Normal",
            source=client.V1EventSource(component=COMPONENT, host=metadata.get("name")),
            first_timestamp=now, last_timestamp=now, count=1,
            reporting_component=COMPONENT, reporting_instance=metadata.get("name")))


def terminate_instance(instance: str, region: str | None = None) -> None:
    """Terminate ``instance`` through its Auto Scaling group, which starts a replacement (the desired
    size stays). The check's Pod Identity role may do this only to the cluster's own groups."""
    import boto3

    boto3.client("autoscaling", region_name=region).terminate_instance_in_auto_scaling_group(
        InstanceId=instance, ShouldDecrementDesiredCapacity=False)
