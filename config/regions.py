"""The Availability Zone names of each Region, so a config naming one that does not exist fails at
synth, offline, instead of minutes into a deploy.

AZ names are per account (``us-west-2a`` is a different zone in two accounts) and a few zones are
closed to new accounts; ``trainctl preflight`` asks EC2 which of them offer the instance types.
This table only says which names exist. It is kept equal to moto's Region data (moto 5.2.5,
moto/ec2/models/availability_zones_and_regions.py), which tests/unit/cdk/test_config_checks.py checks.
"""

from __future__ import annotations

# Region -> the letters its AZ names end with.
AVAILABILITY_ZONES = {
    "af-south-1": "abc",
    "ap-east-1": "abc",
    "ap-east-2": "abc",
    "ap-northeast-1": "acd",
    "ap-northeast-2": "abcd",
    "ap-northeast-3": "abc",
    "ap-south-1": "abc",
    "ap-south-2": "abc",
    "ap-southeast-1": "abc",
    "ap-southeast-2": "abc",
    "ap-southeast-3": "abc",
    "ap-southeast-4": "abc",
    "ap-southeast-5": "abc",
    "ap-southeast-6": "abc",
    "ap-southeast-7": "abc",
    "ca-central-1": "abd",
    "ca-west-1": "abc",
    "cn-north-1": "ab",
    "cn-northwest-1": "abc",
    "eu-central-1": "abc",
    "eu-central-2": "abc",
    "eu-north-1": "abc",
    "eu-south-1": "abc",
    "eu-south-2": "abc",
    "eu-west-1": "abc",
    "eu-west-2": "abc",
    "eu-west-3": "abc",
    "il-central-1": "abc",
    "me-central-1": "abc",
    "me-south-1": "abc",
    "mx-central-1": "abc",
    "sa-east-1": "abc",
    "us-east-1": "abcdef",
    "us-east-2": "abc",
    "us-gov-east-1": "abc",
    "us-gov-west-1": "abc",
    "us-west-1": "ab",
    "us-west-2": "abcd",
}


def availability_zones(region: str) -> list[str] | None:
    """The AZ names of ``region``, or None for a Region this table does not know (a newer one)."""
    letters = AVAILABILITY_ZONES.get(region)
    return None if letters is None else [region + letter for letter in letters]
