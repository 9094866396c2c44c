"""Pinned upstream Helm charts the platform installs through the cluster's kubectl provider.

Device plugins run only where their device is and tolerate that node's taint; the
controllers run on system nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration, aws_eks_v2 as eks, aws_events as events, aws_events_targets as targets, aws_iam as iam, aws_sqs as sqs
from constructs import Construct

from cdk_constructs.nag import acknowledge
from cdk_constructs.pod_identity import PodIdentityRole
from config import PlatformConfig
from config.catalog import ACCELERATOR_LABEL, EFA_PRESENT_LABEL, NODE_ROLE_LABEL, SYSTEM_ROLE, Accelerator
from k8s_charts import volcano

EKS_CHARTS = "https://aws.github.io/eks-charts"
SYSTEM_NODES = {NODE_ROLE_LABEL: SYSTEM_ROLE}


def _tolerate(key: str) -> dict:
    return {"key": key, "operator": "Exists", "effect": "NoSchedule"}


@dataclass(frozen=True)
class ClusterChartsProps:
    cluster: eks.Cluster
    config: PlatformConfig


class ClusterCharts(Construct):
    def __init__(self, scope: Construct, id: str, props: ClusterChartsProps) -> None:
        super().__init__(scope, id)
        self._cluster, config = props.cluster, props.config
        self._cluster_name = config.name_prefix  # literal: it appears in IAM condition keys
        versions = config.versions
        families = {g.instance.accelerator for g in config.accelerated_node_groups}
        if Accelerator.NVIDIA in families:
            self._chart("NvidiaDevicePlugin", "nvidia-device-plugin", "https://nvidia.github.io/k8s-device-plugin",
                        versions.nvidia_device_plugin_chart, "kube-system", {
                            # The chart's default affinity wants GPU feature labels EKS nodes do not carry.
                            "affinity": None,
                            "nodeSelector": {ACCELERATOR_LABEL: Accelerator.NVIDIA.value},
                            "tolerations": [_tolerate("nvidia.com/gpu")],
                        })
        if Accelerator.NEURON in families:
            self._chart("Neuron", "neuron-helm-chart", "oci://public.ecr.aws/neuron/neuron-helm-chart",
                        versions.neuron_chart, "kube-system", {
                            "npd": {"enabled": False},
                            "devicePlugin": {"enabled": True,
                                             "nodeSelector": {ACCELERATOR_LABEL: Accelerator.NEURON.value},
                                             "tolerations": [_tolerate("aws.amazon.com/neuron")]},
                            # Off: the chart pins its scheduler extension to control-plane nodes
                            # (node-role.kubernetes.io/master), which EKS has none of, and CDK drops the
                            # null that would remove that selector. Jobs are placed by Volcano.
                            "scheduler": {"enabled": False},
                        })
        if any(g.efa_enabled for g in config.accelerated_node_groups):
            self._chart("EfaDevicePlugin", "aws-efa-k8s-device-plugin", EKS_CHARTS,
                        versions.efa_device_plugin_chart, "kube-system", {
                            "nodeSelector": {EFA_PRESENT_LABEL: "true"},
                            "tolerations": [_tolerate("nvidia.com/gpu"), _tolerate("aws.amazon.com/neuron")],
                        })
        self.volcano = self._chart("Volcano", "volcano", "https://volcano-sh.github.io/helm-charts",
                                   versions.volcano_chart, "volcano-system", volcano.helm_values())
        self._autoscaler(config)
        self._termination_handler(config)

    def _chart(self, id: str, chart: str, repository: str, version: str, namespace: str, values: dict) -> eks.HelmChart:
        # An explicit release name: `helm list` shows the chart's own name, wherever the stack is deployed.
        return self._cluster.add_helm_chart(id, chart=chart, repository=repository, version=version,
                                            release=chart, namespace=namespace, create_namespace=True, values=values,
                                            wait=False, timeout=Duration.minutes(10))

    def _autoscaler(self, config: PlatformConfig) -> None:
        """cluster-autoscaler, allowed to resize only this cluster's node groups."""
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
        minutes = f"{config.cluster.scale_down_idle_minutes}m"
        self._chart("ClusterAutoscaler", "cluster-autoscaler", "https://kubernetes.github.io/autoscaler",
                    config.versions.cluster_autoscaler_chart, "kube-system", {
                        "autoDiscovery": {"clusterName": self._cluster_name},
                        "awsRegion": config.region,
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

    def _termination_handler(self, config: PlatformConfig) -> None:
        """AWS Node Termination Handler in queue mode: spot notices and rebalance hints drain the node."""
        queue = sqs.Queue(self, "InterruptionQueue", retention_period=Duration.minutes(5),
                          encryption=sqs.QueueEncryption.SQS_MANAGED, enforce_ssl=True)
        for name, detail_type in (("SpotInterruption", "EC2 Spot Instance Interruption Warning"),
                                  ("Rebalance", "EC2 Instance Rebalance Recommendation"),
                                  ("StateChange", "EC2 Instance State-change Notification")):
            events.Rule(self, name, event_pattern=events.EventPattern(source=["aws.ec2"], detail_type=[detail_type]),
                        targets=[targets.SqsQueue(queue)])
        sa = "aws-node-termination-handler"
        role = PodIdentityRole(self, "TerminationHandlerIdentity", cluster=self._cluster, namespace="kube-system",
                               service_account=sa, description="Node Termination Handler: reads the interruption queue")
        queue.grant_consume_messages(role.role)
        role.role.add_to_policy(iam.PolicyStatement(
            actions=["ec2:DescribeInstances", "autoscaling:DescribeAutoScalingInstances", "autoscaling:DescribeTags"],
            resources=["*"]))
        acknowledge(role.role, "IAM5", "ec2:DescribeInstances and the autoscaling Describe calls have no "
                    "resource-level permissions; the handler only reads", finding="Resource::*")
        acknowledge(queue, "SQS3", "Interruption notices are useful for two minutes; a message the handler "
                    "cannot process is obsolete, so a dead-letter queue would only hold stale notices")
        self._chart("NodeTerminationHandler", "aws-node-termination-handler",
                    "oci://public.ecr.aws/aws-ec2/helm/aws-node-termination-handler",
                    config.versions.node_termination_handler_chart, "kube-system", {
                        "enableSqsTerminationDraining": True,
                        "queueURL": queue.queue_url,
                        "awsRegion": config.region,
                        "serviceAccount": {"create": True, "name": sa},
                        "nodeSelector": SYSTEM_NODES,
                        "checkTagBeforeDraining": False,
                    })
        self.interruption_queue = queue
