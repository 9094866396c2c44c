"""Pinned upstream Helm charts the platform installs through the cluster's kubectl provider.

Device plugins run only where their device is and tolerate that node's taints, the node check's
too (contract.NODE_CHECK_TAINT: the check waits for the devices they advertise); the controllers run
on system nodes. What each chart does with our values was read in the chart
at its pinned tag (tests/upstream_charts.py holds those facts and the tests hold us to them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any

from aws_cdk import Duration, aws_eks_v2 as eks, aws_iam as iam
from constructs import Construct, IConstruct

from cdk_constructs.nag import acknowledge
from cdk_constructs.pod_identity import PodIdentityRole
from config.catalog import ACCELERATOR_LABEL, EFA_PRESENT_LABEL, NODE_ROLE_LABEL, SYSTEM_ROLE, Accelerator
from k8s_charts import volcano
from k8s_charts.pods import Toleration
from training.contract import NODE_CHECK_TAINT

EKS_CHARTS = "https://aws.github.io/eks-charts"
SYSTEM_NODES = {NODE_ROLE_LABEL: SYSTEM_ROLE}
# Volcano's scheduler creates this queue through the API, past the queue admission webhooks
# (pkg/scheduler/cache/cache.go newDefaultAndRootQueue, v1.15.1), which fail closed until the
# webhook server serves. Its existence proves the webhooks admit queues.
VOLCANO_DEFAULT_QUEUE = "default"


def _tolerate(key: str) -> dict:
    return Toleration(key).to_dict()


def require_label(key: str, *values: str) -> dict:
    """A required node affinity of one term: ``key`` In ``values``."""
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": key, "operator": "In", "values": list(values)}]}]}}}


def nulls(values: Any, path: str = "") -> list[str]:
    """Paths of every null in a Helm values tree. CDK drops nulls, so the chart's default stays."""
    if values is None:
        return [path or "<root>"]
    if isinstance(values, dict):
        return [p for key, value in values.items() for p in nulls(value, f"{path}.{key}" if path else str(key))]
    if isinstance(values, list):
        return [p for i, value in enumerate(values) for p in nulls(value, f"{path}[{i}]")]
    return []


@dataclass(frozen=True)
class ChartVersions:
    """The pinned version of each upstream chart."""

    volcano: str
    cert_manager: str
    cluster_autoscaler: str
    nvidia_device_plugin: str
    neuron: str
    efa_device_plugin: str


@dataclass(frozen=True)
class ClusterChartsProps:
    cluster: eks.ICluster
    # The cluster's name as a literal: it appears in IAM condition keys and cluster-autoscaler's
    # auto-discovery tag, where the cluster's own name token would not do.
    cluster_name: str
    region: str  # cluster-autoscaler's AWS region
    versions: ChartVersions
    system_nodes: IConstruct  # controllers are installed once their nodes exist
    scale_down_idle_minutes: int  # cluster-autoscaler removes a node unneeded this long
    # The accelerator families of the node groups: each gets its device plugin.
    accelerators: AbstractSet[Accelerator] = frozenset()
    efa: bool = False  # some node group has EFA: the EFA device plugin


class ClusterCharts(Construct):
    def __init__(self, scope: Construct, id: str, props: ClusterChartsProps) -> None:
        super().__init__(scope, id)
        self._cluster, self._cluster_name = props.cluster, props.cluster_name
        # Release name -> the values given to Helm (the tests read them).
        self.releases: dict[str, dict] = {}
        versions, families = props.versions, props.accelerators
        # DaemonSet name -> its chart; each is checked after deploy (see _check_device_plugins).
        plugins: dict[str, eks.HelmChart] = {}
        if Accelerator.NVIDIA in families:
            plugins["nvidia-device-plugin"] = self._chart("NvidiaDevicePlugin", "nvidia-device-plugin", "https://nvidia.github.io/k8s-device-plugin",
                        versions.nvidia_device_plugin, "kube-system", {
                            # Chart 0.17.1's default affinity requires NFD's PCI labels, which EKS managed
                            # nodes never carry (deployments/helm/nvidia-device-plugin/values.yaml, v0.17.1).
                            # A null cannot remove it (CDK drops nulls); Helm replaces lists, so this term
                            # list replaces the chart's three.
                            "affinity": require_label(ACCELERATOR_LABEL, Accelerator.NVIDIA.value),
                            "nodeSelector": {ACCELERATOR_LABEL: Accelerator.NVIDIA.value},
                            "tolerations": [_tolerate("nvidia.com/gpu"), _tolerate(NODE_CHECK_TAINT)],
                        })
        if Accelerator.NEURON in families:
            # Chart 1.1.2 keeps its own affinity (instance type among its Neuron types, not Fargate,
            # hybrid or Auto Mode); our selector narrows it to the platform's Neuron groups.
            plugins["neuron-device-plugin"] = self._chart("Neuron", "neuron-helm-chart", "oci://public.ecr.aws/neuron/neuron-helm-chart",
                        versions.neuron, "kube-system", {
                            "npd": {"enabled": False},
                            "devicePlugin": {"enabled": True,
                                             "nodeSelector": {ACCELERATOR_LABEL: Accelerator.NEURON.value},
                                             "tolerations": [_tolerate("aws.amazon.com/neuron"),
                                                             _tolerate(NODE_CHECK_TAINT)]},
                            # Off (the chart's default too): jobs are placed by Volcano.
                            "scheduler": {"enabled": False},
                        })
        if props.efa:
            # The chart's template adds a required affinity on its list of EFA instance types.
            plugins["aws-efa-k8s-device-plugin"] = self._chart("EfaDevicePlugin", "aws-efa-k8s-device-plugin", EKS_CHARTS,
                        versions.efa_device_plugin, "kube-system", {
                            "nodeSelector": {EFA_PRESENT_LABEL: "true"},
                            "tolerations": [_tolerate("nvidia.com/gpu"), _tolerate("aws.amazon.com/neuron"),
                                            _tolerate(NODE_CHECK_TAINT)],
                        })
        self.volcano = self._volcano(versions.volcano, props.system_nodes)
        # Issues and renews etcd's certificates (k8s_charts/platform_charts.py, EtcdCertificatesChart).
        # With wait: its webhook admits Certificates only once it serves. global.nodeSelector reaches
        # the controller, webhook, cainjector and the start-up check (values.yaml, v1.20.3).
        self.cert_manager = self._chart("CertManager", "cert-manager", "https://charts.jetstack.io",
                                        versions.cert_manager, "cert-manager", {
                                            "crds": {"enabled": True, "keep": True},
                                            "global": {"nodeSelector": SYSTEM_NODES},
                                        }, wait=True)
        self.cert_manager.node.add_dependency(props.system_nodes)
        self._autoscaler(props)
        self.device_plugin_checks = self._check_device_plugins(plugins)

    def _check_device_plugins(self, plugins: dict[str, eks.HelmChart]) -> list[eks.KubernetesObjectValue]:
        """Each plugin's DaemonSet exists and its controller has reconciled it (a deploy fails otherwise).

        With no accelerated node up, ready is vacuous; where the DaemonSets may run is held to
        the node groups' labels offline (tests/unit/cdk/test_first_deploy.py).
        """
        checks = []
        for name, chart in plugins.items():
            check = eks.KubernetesObjectValue(
                self, f"Check-{name}", cluster=self._cluster, object_type="daemonset", object_name=name,
                object_namespace="kube-system", json_path=".status.observedGeneration", timeout=Duration.minutes(5))
            check.node.add_dependency(chart)
            checks.append(check)
        return checks

    def _chart(self, id: str, chart: str, repository: str, version: str, namespace: str, values: dict,
               wait: bool = False) -> eks.HelmChart:
        found = nulls(values)
        if found:
            raise ValueError(f"Helm values of {chart} hold null at {', '.join(found)}: CDK drops nulls, so the "
                             "chart's default would stay; give the value explicitly")
        self.releases[chart] = values
        # An explicit release name: `helm list` shows the chart's own name, wherever the stack is deployed.
        return self._cluster.add_helm_chart(id, chart=chart, repository=repository, version=version,
                                            release=chart, namespace=namespace, create_namespace=True, values=values,
                                            wait=wait, timeout=Duration.minutes(15))

    def _volcano(self, version: str, system_nodes: IConstruct) -> IConstruct:
        """Volcano on system nodes, installed with wait; done once its admission webhooks admit queues.

        The chart's webhooks fail closed (failurePolicy: Fail, templates/webhooks.yaml, v1.15.1)
        and the CDK kubectl handler retries only i/o timeouts, so an object applied before the
        webhook server serves would roll the stack back.
        """
        chart = self._chart("Volcano", "volcano", "https://volcano-sh.github.io/helm-charts",
                            version, "volcano-system",
                            volcano.helm_values(SYSTEM_NODES), wait=True)
        chart.node.add_dependency(system_nodes)
        serving = eks.KubernetesObjectValue(
            self, "VolcanoAdmissionServing", cluster=self._cluster, object_type="queues.scheduling.volcano.sh",
            object_name=VOLCANO_DEFAULT_QUEUE, object_namespace="default", json_path=".metadata.uid",
            timeout=Duration.minutes(10))
        serving.node.add_dependency(chart)
        return serving

    def _autoscaler(self, props: ClusterChartsProps) -> None:
        """cluster-autoscaler of the cluster's minor, allowed to resize only this cluster's node groups."""
        sa = "cluster-autoscaler"
        role = PodIdentityRole(self, "AutoscalerIdentity", cluster=self._cluster, namespace="kube-system",
                               service_account=sa, description="cluster-autoscaler: resizes this cluster's groups")
        role.role.add_to_policy(iam.PolicyStatement(
            actions=["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"],
            resources=["*"],
            conditions={"StringEquals": {
                f"aws:ResourceTag/k8s.io/cluster-autoscaler/{self._cluster_name}": "owned"}},
        ))
        role.role.add_to_policy(iam.PolicyStatement(
            actions=["autoscaling:DescribeAutoScalingGroups", "autoscaling:DescribeAutoScalingInstances",
                     "autoscaling:DescribeLaunchConfigurations", "autoscaling:DescribeScalingActivities",
                     "autoscaling:DescribeTags", "ec2:DescribeImages", "ec2:DescribeInstanceTypes",
                     "ec2:DescribeLaunchTemplateVersions", "ec2:GetInstanceTypesFromInstanceRequirements",
                     "eks:DescribeNodegroup"],
            resources=["*"],
        ))
        acknowledge(role.role, "IAM5", "The Describe* calls cluster-autoscaler makes have no resource-level "
                    "permissions; the two that change capacity are limited by a condition to groups tagged as "
                    "owned by this cluster", finding="Resource::*")
        minutes = f"{props.scale_down_idle_minutes}m"
        chart = self._chart("ClusterAutoscaler", "cluster-autoscaler", "https://kubernetes.github.io/autoscaler",
                            props.versions.cluster_autoscaler, "kube-system", {
                                "autoDiscovery": {"clusterName": self._cluster_name},
                                "awsRegion": props.region,
                                "rbac": {"serviceAccount": {"create": True, "name": sa}},
                                "nodeSelector": SYSTEM_NODES,
                                "extraArgs": {
                                    "scale-down-unneeded-time": minutes,
                                    "scale-down-delay-after-add": minutes,
                                    "skip-nodes-with-local-storage": False,
                                    "balance-similar-node-groups": True,
                                    "expander": "least-waste",
                                },
                            })
        chart.node.add_dependency(props.system_nodes)
