"""Read-only checks that an account can run a config, before a long deploy."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from config import PlatformConfig
from config.catalog import CATALOG, lookup

BOOTSTRAP_STACK = "CDKToolkit"
# EC2 vCPU quotas by instance family (Service Quotas codes for On-Demand and Spot).
ON_DEMAND_QUOTAS = {
    "p": ("L-417A185B", "Running On-Demand P instances"),
    "g": ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    "trn": ("L-2C3B7624", "Running On-Demand Trn instances"),
    "standard": ("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances"),
}
SPOT_QUOTAS = {
    "p": ("L-7212CCBC", "All P Spot Instance Requests"),
    "g": ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    "trn": ("L-6B0D517C", "All Trn Spot Instance Requests"),
    "standard": ("L-34B43A08", "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests"),
}


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str
    fix: str = ""


def quota_family(instance_type: str) -> str:
    family = lookup(instance_type).family
    if family.startswith("trn"):
        return "trn"
    if family[0] in "pg":
        return family[0]
    return "standard"


def run_preflight(config: PlatformConfig, session) -> list[Check]:
    ec2 = session.client("ec2", region_name=config.region)
    checks = offering_checks(config, ec2)
    checks += efa_checks(config, ec2)
    checks += quota_checks(config, session.client("service-quotas", region_name=config.region))
    checks.append(bootstrap_check(config, session.client("cloudformation", region_name=config.region)))
    return checks


def _types(config: PlatformConfig) -> list[str]:
    return sorted({g.instance_type for g in config.accelerated_node_groups} | {config.system_node_group.instance_type})


def _offered(ec2, types: list[str], az: str | None = None) -> dict[str, set[str]]:
    filters = [{"Name": "instance-type", "Values": types}]
    if az:
        filters.append({"Name": "location", "Values": [az]})
    offered: dict[str, set[str]] = defaultdict(set)
    for page in ec2.get_paginator("describe_instance_type_offerings").paginate(
            LocationType="availability-zone", Filters=filters):
        for offering in page["InstanceTypeOfferings"]:
            offered[offering["InstanceType"]].add(offering["Location"])
    return offered


def offering_checks(config: PlatformConfig, ec2) -> list[Check]:
    types = _types(config)
    in_az = _offered(ec2, types, config.compute_az)
    everywhere = _offered(ec2, types)
    good_azs = sorted(set.intersection(*(everywhere.get(t, set()) for t in types))) if types else []
    checks = []
    for instance_type in types:
        ok = config.compute_az in in_az.get(instance_type, set())
        where = ", ".join(sorted(everywhere.get(instance_type, set()))) or f"no AZ of {config.region}"
        fix = (f"set compute_az to an AZ offering every type: {', '.join(good_azs)}" if good_azs
               else f"{instance_type} is offered in {where}; choose other types or another region")
        checks.append(Check(f"{instance_type} offered in {config.compute_az}", ok,
                            "offered" if ok else f"offered only in {where}", "" if ok else fix))
    return checks


def efa_checks(config: PlatformConfig, ec2) -> list[Check]:
    types = sorted({g.instance_type for g in config.accelerated_node_groups})
    described = {t["InstanceType"]: t for t in ec2.describe_instance_types(InstanceTypes=types)["InstanceTypes"]}
    checks = []
    for instance_type in types:
        network = described.get(instance_type, {}).get("NetworkInfo", {})
        actual = network.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0) if network.get("EfaSupported") else 0
        expected = CATALOG[instance_type].efa_interfaces
        ok = actual == expected
        checks.append(Check(f"{instance_type} EFA interfaces", ok, f"EC2 says {actual}, catalog says {expected}",
                            "" if ok else "catalog bug: correct efa_interfaces in config/catalog.py and report it"))
    return checks


def quota_checks(config: PlatformConfig, quotas) -> list[Check]:
    needed: dict[tuple[str, str, str], int] = defaultdict(int)
    groups = [(g.instance_type, g.max_size, g.capacity_type.value) for g in config.accelerated_node_groups]
    groups.append((config.system_node_group.instance_type, config.system_node_group.max_size, "ON_DEMAND"))
    for instance_type, nodes, capacity in groups:
        table = SPOT_QUOTAS if capacity == "SPOT" else ON_DEMAND_QUOTAS
        code, name = table[quota_family(instance_type)]
        needed[(code, name, capacity)] += nodes * lookup(instance_type).vcpus
    checks = []
    for (code, name, _capacity), vcpus in sorted(needed.items()):
        value = int(quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
        ok = value >= vcpus
        checks.append(Check(f"quota {name}", ok, f"{value} vCPUs, need {vcpus} (max nodes x vCPUs)",
                            "" if ok else f"request {vcpus} vCPUs for {code} in Service Quotas, or lower max_size"))
    return checks


def bootstrap_check(config: PlatformConfig, cloudformation) -> Check:
    from botocore.exceptions import ClientError

    try:
        stack = cloudformation.describe_stacks(StackName=BOOTSTRAP_STACK)["Stacks"][0]
        return Check("CDK bootstrap", True, f"{BOOTSTRAP_STACK} is {stack['StackStatus']}")
    except ClientError as exc:
        if "does not exist" not in str(exc):
            raise
        return Check("CDK bootstrap", False, f"no {BOOTSTRAP_STACK} stack in {config.region}",
                     f"npx cdk bootstrap aws://<account>/{config.region}")


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{'PASS' if c.passed else 'FAIL'}  {c.name:<{width}}  {c.detail}")
        if not c.passed:
            lines.append(f"{'':6}{'':<{width}}  fix: {c.fix}")
    failed = sum(not c.passed for c in checks)
    lines.append(f"{len(checks) - failed} passed, {failed} failed")
    return "\n".join(lines)
