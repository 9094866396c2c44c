"""A service account that may change the Node its own pod runs on, and there only what it names.

RBAC cannot name "the node this pod runs on", so the account may get and patch nodes, and a
ValidatingAdmissionPolicy narrows every write it makes: to the Node named in its pod-bound token
(``authentication.kubernetes.io/node-name`` in the request's user extra, set by kube-apiserver from
1.30 and always from 1.32: KEP-4193, ServiceAccountTokenPodNodeInfo; kubernetes/apiserver v0.31.0
pkg/authentication/serviceaccount/util.go, NodeNameKey), and to the taints, labels and annotations
given. A token without that claim (a Secret-based one) is denied. Policies are GA since 1.30
(admissionregistration.k8s.io/v1); a patch of an existing object is admitted as an UPDATE
(apiserver pkg/endpoints/handlers/patch.go), of the main resource unless it names ``nodes/status``.
"""

from __future__ import annotations

from constructs import Construct

from k8s_charts.objects import k8s_object

NODE_NAME_CLAIM = "authentication.kubernetes.io/node-name"


def removes_taint(key: str) -> str:
    """CEL: the taints are as they were, or as they were without ``key``."""
    return ("variables.new_taints == variables.old_taints || variables.new_taints == "
            f"variables.old_taints.filter(t, t.key != '{key}')")


def adds_taint(key: str, effect: str) -> str:
    """CEL: the taints are as they were, or as they were with a ``key`` taint of ``effect`` added."""
    return ("variables.new_taints == variables.old_taints || (variables.new_taints.filter(t, t.key != "
            f"'{key}') == variables.old_taints.filter(t, t.key != '{key}') && variables.new_taints.exists(t, "
            f"t.key == '{key}' && t.effect == '{effect}') && !variables.old_taints.exists(t, t.key == '{key}'))")


def _unchanged_except(allowed: tuple[str, ...], field: str) -> str:
    """CEL: the object's ``field`` map (labels, annotations) differs from the old one only in ``allowed`` keys."""
    keys = " || ".join(f"k == '{key}'" for key in allowed) or "false"
    new, old = f"variables.new_{field}", f"variables.old_{field}"
    return (f"{new}.all(k, {keys} || (k in {old} && {old}[k] == {new}[k])) && "
            f"{old}.all(k, {keys} || k in {new})")


def own_node_policy(name: str, who: str, username: str, *, taints: str, labels: tuple[str, ...] = (),
                    annotations: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """The ValidatingAdmissionPolicy ``name`` and its binding's spec: ``username`` may update only the Node
    its token names, change its taints only as ``taints`` (CEL) allows, and no label or annotation but those given."""

    def either(field: str, path: str, empty: str) -> str:
        return f"has({field}.{path}) ? {field}.{path} : {empty}"

    variables = [
        {"name": "token_node", "expression": (
            f"has(request.userInfo.extra) && '{NODE_NAME_CLAIM}' in request.userInfo.extra && "
            f"size(request.userInfo.extra['{NODE_NAME_CLAIM}']) == 1 ? "
            f"request.userInfo.extra['{NODE_NAME_CLAIM}'][0] : ''")},
        {"name": "old_labels", "expression": either("oldObject", "metadata.labels", "{}")},
        {"name": "new_labels", "expression": either("object", "metadata.labels", "{}")},
        {"name": "old_annotations", "expression": either("oldObject", "metadata.annotations", "{}")},
        {"name": "new_annotations", "expression": either("object", "metadata.annotations", "{}")},
        {"name": "old_taints", "expression": either("oldObject", "spec.taints", "[]")},
        {"name": "new_taints", "expression": either("object", "spec.taints", "[]")},
    ]
    validations = [
        {"expression": "request.operation == 'UPDATE' && (!has(request.subResource) || request.subResource == '')",
         "message": f"{who} may only update a Node itself (no create, delete or status)"},
        {"expression": "variables.token_node != '' && variables.token_node == request.name",
         "message": f"{who} may only change the Node its pod runs on (the token's node-name)"},
        {"expression": taints, "message": f"{who} may not change these taints"},
        {"expression": _unchanged_except(labels, "labels"),
         "message": f"{who} may set no label but {', '.join(labels) or 'none'}"},
        {"expression": _unchanged_except(annotations, "annotations"),
         "message": f"{who} may set no annotation but {', '.join(annotations) or 'none'}"},
        {"expression": ("object.spec.all(k, k == 'taints' || (k in oldObject.spec && object.spec[k] == "
                        "oldObject.spec[k])) && oldObject.spec.all(k, k == 'taints' || k in object.spec)"),
         "message": f"{who} may only change the Node's taints in its spec"},
    ]
    policy = {
        "failurePolicy": "Fail",
        "matchConstraints": {"resourceRules": [{
            "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE", "DELETE"],
            "resources": ["nodes", "nodes/status"]}]},
        "matchConditions": [{"name": "this-account-only", "expression": f"request.userInfo.username == '{username}'"}],
        "variables": variables,
        "validations": validations,
    }
    return policy, {"policyName": name, "validationActions": ["Deny"]}


def own_node_objects(scope: Construct, name: str, labels: dict[str, str], subjects: list[dict],
                     policy: tuple[dict, dict]) -> None:
    """The ClusterRole (get and patch nodes) and its binding to ``subjects``, and the policy that narrows it."""
    metadata = {"name": name, "labels": labels}
    k8s_object(scope, f"{name}-role", api_version="rbac.authorization.k8s.io/v1", kind="ClusterRole",
               metadata=metadata, rules=[{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}])
    k8s_object(scope, f"{name}-binding", api_version="rbac.authorization.k8s.io/v1", kind="ClusterRoleBinding",
               metadata=metadata, subjects=subjects,
               roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name})
    spec, binding = policy
    k8s_object(scope, f"{name}-policy", api_version="admissionregistration.k8s.io/v1",
               kind="ValidatingAdmissionPolicy", metadata=metadata, spec=spec)
    k8s_object(scope, f"{name}-policy-binding", api_version="admissionregistration.k8s.io/v1",
               kind="ValidatingAdmissionPolicyBinding", metadata=metadata, spec=binding)
