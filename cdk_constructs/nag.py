"""Acknowledging cdk-nag findings, always with the reason a reviewer reads."""

from __future__ import annotations

import json

from aws_cdk import Acknowledgment, Stack, Token, Validations
from constructs import IConstruct


def acknowledge(scope: IConstruct, rule: str, reason: str, finding: str | None = None) -> None:
    """Accept AwsSolutions ``rule`` (e.g. ``"IAM4"``) on ``scope`` and below, for ``reason``.

    Rules that report per finding (IAM4 per managed policy, IAM5 per wildcard) need the
    ``finding`` as cdk-nag prints it, e.g. ``"Resource::*"``; each finding is accepted on its own.
    """
    rule_id = f"AwsSolutions::AwsSolutions-{rule}" + (f"[{finding}]" if finding else "")
    Validations.of(scope).acknowledge(Acknowledgment(id=rule_id, reason=reason))


def as_finding(scope: IConstruct, value: str) -> str:
    """``value`` the way cdk-nag prints it in a finding: literal text, or the resolved intrinsic as JSON."""
    if not Token.is_unresolved(value):
        return value
    return json.dumps(Stack.of(scope).resolve(value), separators=(",", ":"))


def account_in_finding(scope: IConstruct) -> str:
    """The account as it appears in findings: a literal id, or ``<AWS::AccountId>`` for an agnostic stack."""
    account = Stack.of(scope).account
    return "<AWS::AccountId>" if Token.is_unresolved(account) else account
