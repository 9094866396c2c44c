"""Acknowledging cdk-nag findings, always with the reason a reviewer reads."""

from __future__ import annotations

from aws_cdk import Acknowledgment, Validations
from constructs import IConstruct


def acknowledge(scope: IConstruct, rule: str, reason: str, finding: str | None = None) -> None:
    """Accept AwsSolutions ``rule`` (e.g. ``"IAM4"``) on ``scope`` and below, for ``reason``.

    Rules that report per finding (IAM4 per managed policy, IAM5 per wildcard) need the
    ``finding`` as cdk-nag prints it, e.g. ``"Resource::*"``; each finding is accepted on its own.
    """
    rule_id = f"AwsSolutions::AwsSolutions-{rule}" + (f"[{finding}]" if finding else "")
    Validations.of(scope).acknowledge(Acknowledgment(id=rule_id, reason=reason))
