"""Mistakes a user can cause, each reported as one line: what happened and how to fix it."""

from __future__ import annotations

import json
import re

# A Kubernetes object name (DNS-1123 subdomain): what the API server accepts in a URL path. An
# empty name would address the whole collection instead of one object.
_OBJECT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class UserError(Exception):
    """Printed as ``error: <cause>; fix: <fix>`` with exit code 2, without a traceback."""

    def __init__(self, cause: str, fix: str):
        self.cause, self.fix = cause, fix
        super().__init__(f"{cause}; fix: {fix}")


def check_name(field: str, value: str) -> str:
    """``value`` if it can name one Kubernetes object, else a UserError naming the field."""
    if not isinstance(value, str) or len(value) > 253 or not _OBJECT_NAME.match(value):
        raise UserError(f"{field}: got {json.dumps(value)}",
                        "allowed: a job name (lowercase letters, digits and '-', starting and ending with a letter "
                        "or digit); see `trainctl list`")
    return value


def from_aws(exc: Exception, region: str) -> UserError | None:
    """Translate the botocore errors users cause into one line, or None for real faults."""
    from botocore.exceptions import (
        ClientError, EndpointConnectionError, NoCredentialsError, NoRegionError, ProfileNotFound,
    )

    if isinstance(exc, ProfileNotFound):
        import botocore.session

        profiles = ", ".join(sorted(botocore.session.Session().full_config.get("profiles", {}))) or (
            "none is configured; run `aws configure sso` or `aws configure --profile NAME`")
        return UserError(f"AWS profile {exc.kwargs.get('profile')!r} not found (--profile or AWS_PROFILE)",
                         f"use one of: {profiles}")
    if isinstance(exc, NoCredentialsError):
        return UserError("no AWS credentials found", "set AWS_PROFILE, run `aws sso login`, or export AWS_ACCESS_KEY_ID")
    if isinstance(exc, NoRegionError):
        return UserError("no AWS region", "set `region` in the config")
    if isinstance(exc, EndpointConnectionError):
        return UserError(f"cannot reach AWS in region {region!r}", "check `region` in the config and your network")
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("UnrecognizedClientException", "InvalidClientTokenId", "ExpiredToken", "ExpiredTokenException"):
            return UserError(f"AWS rejected the credentials ({code})", "refresh them (`aws sso login`) or pick another profile")
        if code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation"):
            return UserError(f"AWS denied {exc.operation_name} ({code})", "use a role allowed to call it")
    return None


_FORBIDDEN = re.compile(r'(?:User|ServiceAccount) "(?P<who>[^"]+)" cannot (?P<verb>\w+) resource "(?P<resource>[^"]+)"'
                        r'(?: in API group "(?P<group>[^"]*)")?(?: in the namespace "(?P<namespace>[^"]+)")?')


def from_kube(exc: Exception, server: str) -> UserError | None:
    """Translate the Kubernetes API errors users meet every day into one line, or None."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError as TransportError

    if isinstance(exc, TransportError):
        return UserError(f"cannot reach the cluster's API server at {server}",
                         "the endpoint admits only cluster.endpoint_access_cidrs (and the VPC): connect from one of "
                         "them or add your network there and redeploy; check your VPN")
    if not isinstance(exc, ApiException):
        return None
    message = _status_message(exc)
    if exc.status == 401:
        return UserError("the cluster does not know this identity (HTTP 401: no access entry, or an expired token)",
                         "add your role to cluster.admin_principal_arns and redeploy, or ask for an access entry; "
                         "check --profile")
    if exc.status == 403:
        found = _FORBIDDEN.search(message)
        if found:
            what = found["resource"] + (f".{found['group']}" if found["group"] else "")
            where = f" in namespace {found['namespace']}" if found["namespace"] else " (cluster-wide)"
            return UserError(f"{found['who']} may not {found['verb']} {what}{where} (HTTP 403)",
                             "grant that verb through its access entry's policy (e.g. AmazonEKSEditPolicy for the "
                             "jobs namespace) or Kubernetes RBAC")
        return UserError(f"the cluster refused the request (HTTP 403: {message})",
                         "grant this identity the verb through its access entry's policy or Kubernetes RBAC")
    if exc.status == 409:
        return UserError(f"the cluster reports a conflict (HTTP 409: {message})",
                         "the object is being deleted or was changed meanwhile; retry in a few seconds")
    if exc.status in (400, 422):
        return UserError(f"the cluster rejected the request (HTTP {exc.status}: {message})",
                         "correct what the message names in the job spec; an admission webhook's denial names its rule")
    if exc.status >= 500:
        return UserError(f"the cluster's API server failed (HTTP {exc.status}: {message})",
                         "retry in a minute; if it persists, check the cluster's health in the EKS console")
    return None


def _status_message(exc) -> str:
    """The ``message`` of a Kubernetes Status body, else the HTTP reason; on one line."""
    try:
        message = json.loads(exc.body or "{}").get("message") or exc.reason
    except (ValueError, AttributeError):
        message = exc.reason
    return " ".join(str(message or "").split())
