"""Kubernetes objects written as plain dicts, the shape ``kubectl explain`` documents."""

from __future__ import annotations

from typing import Any

from cdk8s import ApiObject, JsonPatch
from constructs import Construct


def k8s_object(scope: Construct, id: str, *, api_version: str, kind: str, metadata: dict, **body: Any) -> ApiObject:
    """An ApiObject with top-level fields (``spec``, ``value`` ...) beside its metadata."""
    obj = ApiObject(scope, id, api_version=api_version, kind=kind, metadata=metadata)
    for field, value in body.items():
        obj.add_json_patch(JsonPatch.add(f"/{field}", value))
    return obj


def checkov_skips(skips: dict[str, str]) -> dict[str, str]:
    """Annotations by which checkov accepts ``check id -> one-line reason`` on this object.

    checkov reads them on the object's own metadata only (not a pod template's), one check each,
    as ``checkov.io/skip<N>: <check>=<reason>``; an ``=`` in a reason breaks its parsing.
    """
    for check, reason in skips.items():
        if "=" in reason or not reason.strip():
            raise ValueError(f"checkov skip {check}: a reason without '=', got {reason!r}")
    return {f"checkov.io/skip{i}": f"{check}={reason}" for i, (check, reason) in enumerate(skips.items(), start=1)}
