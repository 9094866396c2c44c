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
