"""Read-only checks that an account can run a config, before a long deploy."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import re

from config import PlatformConfig
from config.catalog import CATALOG, lookup
from config.versions import ADDON_VERSIONS

# The EKS add-ons the cluster stack creates (cdk_constructs/cluster_addons.py).
PLATFORM_ADDONS = ("eks-pod-identity-agent", "vpc-cni", "kube-proxy", "coredns", "aws-fsx-csi-driver",
                   "aws-ebs-csi-driver", "amazon-cloudwatch-observability", "eks-node-monitoring-agent")

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
    checks = [az_check(config, ec2)]
    checks += offering_checks(config, ec2)
    checks += efa_checks(config, ec2)
    checks += quota_checks(config, session.client("service-quotas", region_name=config.region),
                           extra_groups=slurm_groups(config))
    if config.slurm is not None:
        from config.versions import PARALLELCLUSTER_VERSION

        checks.append(provider_template_check(session.client("s3", region_name=config.region), config.region,
                                              PARALLELCLUSTER_VERSION))
        checks += slurm_checks(session, region=config.region, stack_name=config.stack_name("slurm"),
                               cluster_name=config.slurm_cluster_name, pcluster_version=PARALLELCLUSTER_VERSION)
    checks.append(bootstrap_check(config, session.client("cloudformation", region_name=config.region)))
    checks.append(access_check(config, session.client("sts", region_name=config.region)))
    checks += addon_checks(config, session.client("eks", region_name=config.region))
    return checks


def az_check(config: PlatformConfig, ec2) -> Check:
    """Both AZs the config names exist in the region for this account."""
    zones = sorted(z["ZoneName"] for z in ec2.describe_availability_zones(
        Filters=[{"Name": "zone-type", "Values": ["availability-zone"]}])["AvailabilityZones"])
    missing = [az for az in (config.compute_az, config.control_plane_az) if az not in zones]
    names = f"{config.compute_az} and {config.control_plane_az}"
    return Check(f"AZs {names} exist", not missing, f"{', '.join(missing)} not in {config.region}" if missing
                 else "both exist", "" if not missing else f"choose AZs among {', '.join(zones)}")


def role_arn(caller_arn: str) -> str:
    """The IAM principal behind a caller: an assumed-role session becomes its role (with the role's path unknown)."""
    match = re.fullmatch(r"arn:(aws[a-z-]*):sts::(\d{12}):assumed-role/([\w+=,.@-]+)/.+", caller_arn)
    if not match:
        return caller_arn
    partition, account, role = match.groups()
    return f"arn:{partition}:iam::{account}:role/{role}"


def _grants(listed: str, principal: str) -> bool:
    """Whether the access entry for ``listed`` covers ``principal``.

    An assumed-role session names its role without the role's path, and SSO roles live under
    one (``role/aws-reserved/sso.amazonaws.com/...``), so roles of one account match by name.
    """
    if listed == principal:
        return True
    if ":role/" not in listed or ":role/" not in principal:
        return False
    return listed.split(":")[4] == principal.split(":")[4] and listed.rsplit("/", 1)[-1] == principal.rsplit("/", 1)[-1]


def access_check(config: PlatformConfig, sts) -> Check:
    """The deploying identity will be able to reach the cluster: it is among admin_principal_arns."""
    principal = role_arn(sts.get_caller_identity()["Arn"])
    listed = any(_grants(arn, principal) for arn in config.cluster.admin_principal_arns)
    return Check("cluster access for the caller", listed, f"you are {principal}",
                 "" if listed else f"add {principal} to cluster.admin_principal_arns, or kubectl and trainctl "
                 "get 401/403 after the deploy")


def addon_checks(config: PlatformConfig, eks) -> list[Check]:
    """Each add-on version the cluster will be created with is offered for its minor; unpinned ones are named."""
    minor = config.cluster.kubernetes_version
    checks = []
    for addon in PLATFORM_ADDONS:
        if addon == "amazon-cloudwatch-observability" and not config.monitoring.enabled:
            continue
        if addon == "eks-node-monitoring-agent" and not config.cluster.node_monitoring_agent:
            continue
        pinned = config.versions.addons.get(addon) or ADDON_VERSIONS[minor].get(addon)
        offered, default = [], None
        for page in eks.get_paginator("describe_addon_versions").paginate(addonName=addon, kubernetesVersion=minor):
            for info in page["addons"]:
                for version in info["addonVersions"]:
                    offered.append(version["addonVersion"])
                    if any(c.get("defaultVersion") for c in version.get("compatibilities", [])):
                        default = version["addonVersion"]
        if pinned:
            ok = pinned in offered
            checks.append(Check(f"add-on {addon} {pinned}", ok, f"offered for Kubernetes {minor}" if ok else
                                f"not offered for Kubernetes {minor}", "" if ok else
                                f"pin one of {', '.join(offered[:5])} in versions.addons.{addon}"))
        else:
            checks.append(Check(f"add-on {addon}", default is not None, f"not pinned: EKS would install {default}",
                                "" if default else f"no version of {addon} is offered for Kubernetes {minor}"))
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


def quota_checks(config: PlatformConfig, quotas, extra_groups: list[tuple[str, int, str]] = ()) -> list[Check]:
    """EC2 vCPU quotas against every node the platform may run at once.

    ``extra_groups``: more (instance type, max nodes, "ON_DEMAND" or "SPOT"), e.g.
    slurm_quota_groups(queues) for the Slurm stack's queues, which draw on the same quotas.
    """
    groups = [(g.instance_type, g.max_size, g.capacity_type.value) for g in config.accelerated_node_groups]
    groups.append((config.system_node_group.instance_type, config.system_node_group.max_size, "ON_DEMAND"))
    # A Batch compute environment draws on the same EC2 quotas, beside the EKS group it mirrors.
    by_name = {g.name: g for g in config.accelerated_node_groups}
    groups += [(by_name[n].instance_type, by_name[n].max_size, by_name[n].capacity_type.value)
               for n in (config.batch.node_groups if config.batch else [])]
    return vcpu_quota_checks([*groups, *extra_groups], quotas)


def vcpu_quota_checks(groups: list[tuple[str, int, str]], quotas) -> list[Check]:
    """One check per quota: the sum of max nodes x vCPUs of the (type, max nodes, capacity) groups."""
    needed: dict[tuple[str, str, str], int] = defaultdict(int)
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


def slurm_groups(config: PlatformConfig) -> list[tuple[str, int, str]]:
    """What the slurm stack may run at once: each queue's max_size nodes, and the head node."""
    if config.slurm is None:
        return []
    by_name = {g.name: g for g in config.accelerated_node_groups}
    queues = [(q.node_group, by_name[q.node_group].instance_type, by_name[q.node_group].max_size)
              for q in config.slurm.queues]
    return [*slurm_quota_groups(queues), (config.slurm.head_node_instance_type, 1, "ON_DEMAND")]


def provider_template_check(s3, region: str, version: str) -> Check:
    """ParallelCluster publishes its custom resource's provider template per version in a bucket of each
    region it supports (User Guide, "AWS CloudFormation custom resource": the provider stack hosted by
    AWS ParallelCluster); the slurm stack nests that template, so a region or version without it fails the deploy."""
    from botocore.exceptions import ClientError

    bucket, key = f"{region}-aws-parallelcluster", f"parallelcluster/{version}/templates/custom_resource/cluster.yaml"
    name = f"ParallelCluster {version} provider in {region}"
    try:
        s3.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        return Check(name, False, f"s3://{bucket}/{key}: {code or exc}",
                     "pick a region ParallelCluster supports, or pin a version published there (config/versions.py)")
    return Check(name, True, f"s3://{bucket}/{key}")


def slurm_quota_groups(queues: list[tuple[str, str, int]]) -> list[tuple[str, int, str]]:
    """The Slurm queues (name, instance type, max nodes) as quota groups: ParallelCluster launches
    its compute nodes On-Demand unless a queue says CapacityType: SPOT, and ours do not."""
    return [(instance_type, max_nodes, "ON_DEMAND") for _name, instance_type, max_nodes in queues]


# What a deployed Slurm stack holds: the ParallelCluster provider (a nested stack from
# cloudformation/custom_resource/cluster.yaml) and a Custom::PclusterCluster, whose Lambda
# returns the ClusterName as the physical id and creates the cluster's own CloudFormation stack,
# named after the cluster (aws-parallelcluster cli/src/pcluster/models/cluster.py:
# Cluster.stack_name is the name) and tagged parallelcluster:version (models/cluster.py,
# cluster_resources.py ClusterStack.version). That stack's status is the cluster's status, with
# rollbacks renamed *_FAILED (api/converters.py cloud_formation_status_to_cluster_status); the
# custom resource's poll counts CREATE_COMPLETE and UPDATE_COMPLETE as done.
PCLUSTER_RESOURCE = "Custom::PclusterCluster"
PCLUSTER_VERSION_TAG = "parallelcluster:version"
HEALTHY_CLUSTER = ("CREATE_COMPLETE", "UPDATE_COMPLETE")
CLUSTER_STATUS = {"ROLLBACK_IN_PROGRESS": "CREATE_FAILED", "ROLLBACK_FAILED": "CREATE_FAILED",
                  "ROLLBACK_COMPLETE": "CREATE_FAILED", "UPDATE_ROLLBACK_FAILED": "UPDATE_FAILED",
                  "UPDATE_ROLLBACK_COMPLETE": "UPDATE_FAILED"}


def slurm_checks(session, *, region: str, stack_name: str, cluster_name: str,
                 pcluster_version: str | None = None) -> list[Check]:
    """The Slurm stack, its ParallelCluster cluster, and the head node trainctl reaches through SSM.

    Quotas are not here: pass slurm_quota_groups(queues) to quota_checks, which sums them with
    the node groups drawing on the same quotas.
    """
    checks = slurm_stack_checks(session.client("cloudformation", region_name=region), stack_name=stack_name,
                                cluster_name=cluster_name, pcluster_version=pcluster_version)
    if checks[0].passed and not checks[0].detail.startswith(NOT_DEPLOYED):
        checks.append(head_node_ssm_check(session.client("ec2", region_name=region),
                                          session.client("ssm", region_name=region), cluster_name=cluster_name,
                                          region=region))
    return checks


NOT_DEPLOYED = "not deployed yet"


def _stack(cloudformation, name: str) -> dict | None:
    from botocore.exceptions import ClientError

    try:
        return cloudformation.describe_stacks(StackName=name)["Stacks"][0]
    except ClientError as exc:
        if "does not exist" not in str(exc):
            raise
        return None


def _stack_fix(name: str, status: str) -> str:
    if status.endswith("_IN_PROGRESS"):
        return "wait for it to finish, then run preflight again"
    return f"see why: aws cloudformation describe-stack-events --stack-name {name}"


def slurm_stack_checks(cloudformation, *, stack_name: str, cluster_name: str,
                       pcluster_version: str | None = None) -> list[Check]:
    stack = _stack(cloudformation, stack_name)
    if stack is None:
        # Before the first deploy, as preflight runs: nothing to check yet (a failure would block the deploy).
        return [Check(f"Slurm stack {stack_name}", True, f"{NOT_DEPLOYED}: `npx cdk deploy {stack_name}` creates "
                      "it; run preflight again afterwards to check the cluster and its head node")]
    status = stack["StackStatus"]
    ok = status.endswith("_COMPLETE") and status not in ("ROLLBACK_COMPLETE", "DELETE_COMPLETE")
    checks = [Check(f"Slurm stack {stack_name}", ok, status, "" if ok else (
        f"its creation failed: delete it and deploy again ({_stack_fix(stack_name, status)})"
        if status == "ROLLBACK_COMPLETE" else _stack_fix(stack_name, status)))]
    resources = [r for page in cloudformation.get_paginator("list_stack_resources").paginate(StackName=stack_name)
                 for r in page["StackResourceSummaries"]]
    providers = [r for r in resources
                 if r["ResourceType"] == "AWS::CloudFormation::Stack" and "ClusterProvider" in r["LogicalResourceId"]]
    if not providers:
        checks.append(Check("ParallelCluster provider", False, f"no nested PclusterClusterProvider stack in "
                            f"{stack_name}", f"deploy {stack_name} from this repository"))
    for provider in providers:
        done = provider["ResourceStatus"] in ("CREATE_COMPLETE", "UPDATE_COMPLETE")
        checks.append(Check(f"ParallelCluster provider {provider['LogicalResourceId']}", done,
                            provider["ResourceStatus"], "" if done else _stack_fix(stack_name, provider["ResourceStatus"])))
    custom = [r for r in resources if r["ResourceType"] == PCLUSTER_RESOURCE]
    if not custom:
        checks.append(Check("ParallelCluster cluster resource", False, f"no {PCLUSTER_RESOURCE} in {stack_name}",
                            f"deploy {stack_name} from this repository"))
        return checks
    named = custom[0].get("PhysicalResourceId")
    if named and named != cluster_name:
        checks.append(Check(f"ParallelCluster cluster {cluster_name}", False, f"{stack_name} holds cluster {named!r}",
                            f"name the cluster {named!r} in the config, or deploy {stack_name} again"))
        return checks
    checks.append(cluster_stack_check(cloudformation, cluster_name, pcluster_version))
    return checks


def cluster_stack_check(cloudformation, cluster_name: str, pcluster_version: str | None = None) -> Check:
    """The cluster's own stack, as `pcluster describe-cluster` reads it (without the pcluster CLI)."""
    name = f"ParallelCluster cluster {cluster_name}"
    stack = _stack(cloudformation, cluster_name)
    if stack is None:
        return Check(name, False, f"no stack {cluster_name}: ParallelCluster did not create the cluster",
                     "see the provider's log group /aws/lambda/pcluster-cfn-* for the custom resource's error")
    tags = {t["Key"]: t["Value"] for t in stack.get("Tags", [])}
    version = tags.get(PCLUSTER_VERSION_TAG)
    if version is None:
        return Check(name, False, f"stack {cluster_name} has no {PCLUSTER_VERSION_TAG} tag: not a ParallelCluster "
                     "cluster", "give the cluster a name no other stack uses")
    status = stack["StackStatus"]
    cluster_status = CLUSTER_STATUS.get(status, status)
    if status not in HEALTHY_CLUSTER:
        return Check(name, False, f"{cluster_status} (stack {status}), ParallelCluster {version}",
                     _stack_fix(cluster_name, status))
    if pcluster_version and version != pcluster_version:
        return Check(name, False, f"ParallelCluster {version}, the stack pins {pcluster_version}",
                     "deploy the Slurm stack again to update the cluster")
    return Check(name, True, f"{cluster_status}, ParallelCluster {version}")


def head_node_ssm_check(ec2, ssm, *, cluster_name: str, region: str) -> Check:
    """trainctl reaches Slurm through SSM Run Command on the head node: its agent must be Online."""
    from trainctl.errors import UserError
    from trainctl.backends.slurm_transport import find_head_node, not_registered, ssm_ping_status

    name = f"head node of {cluster_name} online in SSM"
    try:
        instance = find_head_node(ec2, cluster_name, region)
    except UserError as exc:
        return Check(name, False, exc.cause, exc.fix)
    status = ssm_ping_status(ssm, instance)
    if status == "Online":
        return Check(name, True, f"{instance} is Online")
    error = not_registered(instance, cluster_name, status)
    return Check(name, False, error.cause, error.fix)


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
