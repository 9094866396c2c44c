"""Mistakes a user can cause, each reported as one line: what happened and how to fix it."""

from __future__ import annotations


class UserError(Exception):
    """Printed as ``error: <cause>; fix: <fix>`` with exit code 2, without a traceback."""

    def __init__(self, cause: str, fix: str):
        self.cause, self.fix = cause, fix
        super().__init__(f"{cause}; fix: {fix}")


def from_aws(exc: Exception, region: str) -> UserError | None:
    """Translate the botocore errors users cause into one line, or None for real faults."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, NoRegionError

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
