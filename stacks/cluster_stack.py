"""Cluster stack: EKS with system and EFA-ready accelerated node groups, add-ons, charts, autoscaling."""

from __future__ import annotations

import importlib

from aws_cdk import (
    Annotations, CfnCondition, CfnOutput, Duration, Stack, aws_ec2 as ec2, aws_eks_v2 as eks, aws_iam as iam,
    aws_kms as kms,
)
from aws_cdk.aws_lambda import CfnFunction
from cdk8s import App as Cdk8sApp
from constructs import Construct, IConstruct

from cdk_constructs.accelerated_node_group import AcceleratedNodeGroup, AcceleratedNodeGroupProps
from cdk_constructs.autoscaled_size import AutoscaledSize, AutoscaledSizeProps
from cdk_constructs.cluster_addons import ClusterAddons, ClusterAddonsProps
from cdk_constructs.cluster_charts import ChartVersions, ClusterCharts, ClusterChartsProps
from cdk_constructs.efa_launch_template import CapacityReservation, EfaLaunchTemplate, EfaLaunchTemplateProps
from cdk_constructs.nag import acknowledge
from cdk_constructs.network import RETENTION_BY_DAYS
from cdk_constructs.node_version import NodeVersion, pin_node_version
from cdk_constructs.pod_identity import PodIdentityRole, associate
from cdk_constructs.training_dashboard import TrainingDashboard, TrainingDashboardProps
from config import AcceleratedNodeGroupConfig, PlatformConfig
from config.catalog import NODE_ROLE_LABEL, SYSTEM_ROLE, Accelerator
from config.cluster import ClusterConfig
from k8s_charts.node_check import NODE_CHECK_NAMESPACE, NODE_CHECK_SERVICE_ACCOUNT, NodeCheckChart
from k8s_charts.platform_charts import (
    TRAINER_SERVICE_ACCOUNT, EtcdCertificatesChart, EtcdChart, LustreVolumeValues, NamespacesChart, PlatformCheckChart,
    SchedulingChart, StorageChart, StorageClassChart, platform_check_name,
)
from stacks.network_stack import NetworkStack
from stacks.registry_stack import RegistryStack
from stacks.storage_stack import StorageStack

# The id aws-cdk-lib gives the one Lambda behind every AwsCustomResource in a stack.
AWS_CUSTOM_RESOURCE_SINGLETON = "AWS679f53fac002430cb0da5b7982bd2287"
CONTROL_PLANE_LOGS = [
    eks.ClusterLoggingTypes.API, eks.ClusterLoggingTypes.AUDIT, eks.ClusterLoggingTypes.AUTHENTICATOR,
    eks.ClusterLoggingTypes.CONTROLLER_MANAGER, eks.ClusterLoggingTypes.SCHEDULER,
]


def kubectl_layer(scope: Construct, kubernetes_version: str):
    """The kubectl/helm Lambda layer that matches the cluster's Kubernetes minor version."""
    minor = kubernetes_version.split(".")[1]
    module = importlib.import_module(f"aws_cdk.lambda_layer_kubectl_v{minor}")
    return getattr(module, f"KubectlV{minor}Layer")(scope, "KubectlLayer")


def node_version(config: ClusterConfig) -> NodeVersion:
    """What every managed node group runs: one source, the cluster's config."""
    return NodeVersion(kubernetes=config.node_kubernetes_version, ami_release=config.ami_release_version)


def accelerated_node_group_props(group: AcceleratedNodeGroupConfig, *, cluster: eks.ICluster, subnet: ec2.ISubnet,
                                 node_role: iam.IRole, node_security_group: ec2.ISecurityGroup, version: NodeVersion,
                                 node_check: bool) -> AcceleratedNodeGroupProps:
    """One node group of the config, as the construct takes it: the resources, and the group's facts."""
    reservation = group.capacity_reservation
    return AcceleratedNodeGroupProps(
        cluster=cluster, subnet=subnet, node_role=node_role, node_security_group=node_security_group,
        name=group.name, instance=group.instance,
        min_size=group.min_size, max_size=group.max_size, desired_size=group.desired_size,
        efa=group.efa_enabled, version=version, capacity_type=eks.CapacityType[group.capacity_type.value],
        placement_group=group.placement_group, auto_repair=group.node_auto_repair, node_check=node_check,
        capacity_reservation=CapacityReservation(reservation.id, capacity_block=reservation.kind == "capacity_block")
        if reservation else None,
    )


def cluster_charts_props(config: PlatformConfig, cluster: eks.ICluster, system_nodes: IConstruct
                         ) -> ClusterChartsProps:
    """The upstream charts' pinned versions, and the node groups' facts that choose the device plugins."""
    versions, groups = config.versions, config.accelerated_node_groups
    return ClusterChartsProps(
        cluster=cluster, cluster_name=config.name_prefix, region=config.region,
        versions=ChartVersions(
            volcano=versions.volcano_chart, cert_manager=versions.cert_manager_chart,
            cluster_autoscaler=config.cluster_autoscaler_chart,
            nvidia_device_plugin=versions.nvidia_device_plugin_chart, neuron=versions.neuron_chart,
            efa_device_plugin=versions.efa_device_plugin_chart),
        system_nodes=system_nodes,
        accelerators=frozenset(g.instance.accelerator for g in groups),
        efa=any(g.efa_enabled for g in groups),
        scale_down_idle_minutes=config.cluster.scale_down_idle_minutes,
    )


class ClusterStack(Stack):
    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, network: NetworkStack,
                 registry: RegistryStack, storage: StorageStack, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        net = network.network
        secrets_key = kms.Key(self, "SecretsKey", enable_key_rotation=True,
                              description=f"{config.name_prefix}: EKS secrets envelope encryption")
        self.cluster = eks.Cluster(
            self, "Cluster",
            # A literal name: IAM conditions and the CLI refer to it before the cluster exists.
            cluster_name=config.name_prefix,
            version=eks.KubernetesVersion.of(config.cluster.kubernetes_version),
            vpc=net.vpc,
            vpc_subnets=[net.private_subnets],
            default_capacity_type=eks.DefaultCapacityType.NODEGROUP,
            default_capacity=0,
            endpoint_access=eks.EndpointAccess.PUBLIC_AND_PRIVATE.only_from(*config.cluster.endpoint_access_cidrs),
            cluster_logging=CONTROL_PLANE_LOGS,
            secrets_encryption_key=secrets_key,
            kubectl_provider_options=eks.KubectlProviderOptions(
                kubectl_layer=kubectl_layer(self, config.cluster.kubernetes_version)),
        )
        if "0.0.0.0/0" in config.cluster.endpoint_access_cidrs:
            # Allowed (some teams rely on IAM alone) but seldom meant: say so at every synth.
            Annotations.of(self.cluster).add_warning_v2(
                "platform:endpoint-open-to-internet",
                "cluster.endpoint_access_cidrs contains 0.0.0.0/0: the Kubernetes API endpoint accepts connections "
                "from any address (IAM still authenticates); list your office or VPN ranges instead")
        for i, arn in enumerate(config.cluster.admin_principal_arns):
            self.cluster.grant_access(f"Admin{i}", arn, [eks.AccessPolicy.from_access_policy_name(
                "AmazonEKSClusterAdminPolicy", access_scope_type=eks.AccessScopeType.CLUSTER)])

        file_system = storage.file_system
        self.addons = ClusterAddons(self, "Addons", ClusterAddonsProps(
            cluster=self.cluster, kubernetes_version=config.cluster.kubernetes_version,
            versions=config.versions.addons,
            file_system_arn=self.format_arn(service="fsx", resource="file-system",
                                            resource_name=file_system.volume.file_system_id),
            monitoring=config.monitoring.enabled, node_monitoring_agent=config.cluster.node_monitoring_agent))

        self.dashboard = None
        if config.monitoring.enabled:
            self.dashboard = TrainingDashboard(self, "Monitoring", TrainingDashboardProps(
                cluster_name=config.name_prefix, jobs_namespace=config.jobs.namespace,
                file_system_id=file_system.volume.file_system_id,
                file_system_capacity_gib=config.fsx.storage_capacity_gib,
                log_retention=RETENTION_BY_DAYS[config.monitoring.log_retention_days],
                gpu_groups=tuple(g.name for g in config.accelerated_node_groups
                                 if g.instance.accelerator is Accelerator.NVIDIA),
                neuron_groups=tuple(g.name for g in config.accelerated_node_groups
                                    if g.instance.accelerator is Accelerator.NEURON),
                alarm_topic_arn=config.monitoring.alarm_topic_arn,
                node_check_namespace=NODE_CHECK_NAMESPACE if config.cluster.node_check.enabled else None))
            # Fluent Bit would create the log group on its first write, without a retention.
            self.addons.observability.node.add_dependency(self.dashboard.application_logs)

        node_groups_sgs = [net.node_security_group.security_group_id, self.cluster.cluster_security_group_id]
        system = config.system_node_group
        system_template = EfaLaunchTemplate(self, "SystemLaunchTemplate", EfaLaunchTemplateProps(
            instance=system.instance, efa=False, security_group_ids=node_groups_sgs, placement_group_name=None,
            root_volume_gib=100))
        system_size = AutoscaledSize(self, "SystemDesiredSize", AutoscaledSizeProps(
            cluster=self.cluster, label_key=NODE_ROLE_LABEL, label_value=SYSTEM_ROLE,
            min_size=system.min_size, max_size=system.max_size, initial_size=system.desired_size,
            generation=system_template.version))
        self.system_nodes = eks.Nodegroup(
            self, "SystemNodes", cluster=self.cluster, node_role=registry.node_role,
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_STANDARD,
            launch_template_spec=eks.LaunchTemplateSpec(id=system_template.launch_template_id,
                                                        version=system_template.version),
            subnets=net.private_subnets,
            min_size=system.min_size, desired_size=system_size.desired_size, max_size=system.max_size,
            labels={NODE_ROLE_LABEL: SYSTEM_ROLE},
        )
        # Every group follows cluster.kubernetes_version; each names the cluster by Ref, so a deploy
        # that bumps it updates the control plane first, then rolls the groups (cdk_constructs/node_version.py).
        versions = node_version(config.cluster)
        pin_node_version(self.system_nodes, versions)
        self.accelerated = [
            AcceleratedNodeGroup(self, f"Group-{group.name}", accelerated_node_group_props(
                group, cluster=self.cluster, subnet=net.compute_subnet, node_role=registry.node_role,
                node_security_group=net.node_security_group, version=versions,
                node_check=config.cluster.node_check.enabled))
            for group in config.accelerated_node_groups
        ]
        # Nodes join with the pinned VPC CNI, not the one EKS bootstraps and the add-on then replaces.
        for nodegroup in [self.system_nodes, *(g.nodegroup for g in self.accelerated)]:
            nodegroup.node.add_dependency(self.addons.vpc_cni)

        self.charts = ClusterCharts(self, "Charts", cluster_charts_props(config, self.cluster, self.system_nodes))

        # Training pods read and write the bucket's two prefixes (the role lives with the bucket).
        associate(self, "TrainerIdentity", self.cluster.cluster_name, config.jobs.namespace,
                  TRAINER_SERVICE_ACCOUNT, storage.trainer_role)

        self._platform_charts(config, storage)
        self._acknowledge_generated_resources()
        CfnOutput(self, "ClusterName", value=self.cluster.cluster_name)
        CfnOutput(self, "ClusterEndpoint", value=self.cluster.cluster_endpoint)
        CfnOutput(self, "JobsNamespace", value=config.jobs.namespace)

    def _acknowledge_generated_resources(self) -> None:
        """aws-cdk-lib's own cluster role, kubectl provider and custom-resource Lambda."""
        acknowledge(self.cluster.role, "IAM4", "AmazonEKSClusterPolicy is the policy EKS requires for its "
                    "cluster role", finding="Policy::arn:<AWS::Partition>:iam::aws:policy/AmazonEKSClusterPolicy")
        provider = self.cluster.kubectl_provider
        managed = {
            "service-role/AWSLambdaBasicExecutionRole": "the provider's Lambda functions write their own logs",
            "service-role/AWSLambdaVPCAccessExecutionRole": "the kubectl handler runs in the VPC to reach the private endpoint",
            "AmazonEC2ContainerRegistryReadOnly": "the kubectl handler pulls Helm charts from ECR (the Neuron chart)",
        }
        for policy, why in managed.items():
            acknowledge(provider, "IAM4", f"aws-cdk-lib's kubectl provider: {why}",
                        finding=f"Policy::arn:<AWS::Partition>:iam::aws:policy/{policy}")
        condition = next(c for c in provider.node.find_all() if isinstance(c, CfnCondition))
        acknowledge(provider, "IAM4", "aws-cdk-lib's kubectl provider: public ECR read for OCI Helm charts", finding=(
            'Policy::{"Fn::If":["' + self.get_logical_id(condition) + '",{"Fn::Join":["",["arn:",{"Ref":"AWS::Partition"},'
            '":iam::aws:policy/AmazonElasticContainerRegistryPublicReadOnly"]]},{"Ref":"AWS::NoValue"}]}'))
        handler = next(c for c in provider.node.find_all() if isinstance(c, CfnFunction) and "Handler" in c.node.path)
        acknowledge(provider, "IAM5", "aws-cdk-lib's provider framework invokes any version of its own handler",
                    finding=f"Resource::<{self.get_logical_id(handler)}.Arn>:*")
        acknowledge(provider, "L1", "The kubectl handler's runtime is pinned by aws-cdk-lib to match its kubectl layer")
        custom_resource_lambda = self.node.try_find_child(AWS_CUSTOM_RESOURCE_SINGLETON)
        if custom_resource_lambda is not None:
            acknowledge(custom_resource_lambda, "IAM4", "aws-cdk-lib's AwsCustomResource Lambda writes its own logs",
                        finding="Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole")

    def _platform_charts(self, config: PlatformConfig, storage: StorageStack) -> None:
        """etcd, the Volcano queue and the FSx volume, applied in order after what they need."""
        charts = Cdk8sApp()
        namespaces = self.cluster.add_cdk8s_chart("Namespaces", NamespacesChart(charts, "namespaces", config))
        certificates = self.cluster.add_cdk8s_chart("EtcdCertificates",
                                                    EtcdCertificatesChart(charts, "etcd-certificates", config))
        certificates.node.add_dependency(namespaces, self.charts.cert_manager)  # its CRDs and webhook
        etcd = self.cluster.add_cdk8s_chart("Etcd", EtcdChart(charts, "etcd", config))
        etcd.node.add_dependency(namespaces, self.system_nodes, certificates)
        scheduling = self.cluster.add_cdk8s_chart("Scheduling", SchedulingChart(charts, "scheduling", config))
        scheduling.node.add_dependency(self.charts.volcano)  # Volcano's CRDs are in and its webhooks serve
        storage_class = self.cluster.add_cdk8s_chart("StorageClass", StorageClassChart(charts, "storage-class", config))
        storage_class.node.add_dependency(self.addons.ebs_csi)
        etcd.node.add_dependency(storage_class)  # etcd's volumes come from the class
        volume = storage.file_system.volume
        storage_chart = self.cluster.add_cdk8s_chart("Storage", StorageChart(charts, "storage", config, LustreVolumeValues(
            file_system_id=volume.file_system_id, dns_name=volume.dns_name, mount_name=volume.mount_name,
            capacity_gib=config.fsx.storage_capacity_gib)))
        storage_chart.node.add_dependency(namespaces, self.addons.fsx_csi)  # the CSI driver before its volume
        if config.cluster.node_check.enabled:
            self._node_check(config, charts)
        self._platform_check(config, charts, after=[etcd, scheduling, *self.charts.device_plugin_checks])

    def _node_check(self, config: PlatformConfig, charts: Cdk8sApp) -> None:
        """The admission gate of accelerated nodes (k8s_charts/node_check.py) and, when failed nodes are
        terminated, the one AWS action that needs: through the node's Auto Scaling group, which keeps its
        size and starts a replacement, on this cluster's groups alone (EKS tags a managed node group's
        Auto Scaling group k8s.io/cluster-autoscaler/<cluster>=owned, as cluster-autoscaler's role relies on).
        The check names only its own node's instance; IAM cannot tell which node a pod runs on."""
        self.cluster.add_cdk8s_chart("NodeCheck", NodeCheckChart(charts, "node-check", config))
        if config.cluster.node_check.failed_nodes != "terminate":
            return
        identity = PodIdentityRole(self, "NodeCheckIdentity", cluster=self.cluster, namespace=NODE_CHECK_NAMESPACE,
                                   service_account=NODE_CHECK_SERVICE_ACCOUNT,
                                   description="node check: terminates a node that failed it, which its group replaces")
        identity.role.add_to_policy(iam.PolicyStatement(
            actions=["autoscaling:TerminateInstanceInAutoScalingGroup"], resources=["*"],
            conditions={"StringEquals": {f"aws:ResourceTag/k8s.io/cluster-autoscaler/{config.name_prefix}": "owned"}}))
        acknowledge(identity.role, "IAM5", "TerminateInstanceInAutoScalingGroup is limited by a condition to Auto "
                    "Scaling groups tagged as owned by this cluster", finding="Resource::*")

    def _platform_check(self, config: PlatformConfig, charts: Cdk8sApp, after: list) -> None:
        """A deploy that changes the platform ends by running a small job through Volcano against etcd."""
        job = self.cluster.add_cdk8s_chart("PlatformCheck", PlatformCheckChart(charts, "platform-check", config))
        job.node.add_dependency(*after)
        completed = eks.KubernetesObjectValue(
            self, "PlatformCheckCompleted", cluster=self.cluster, object_type="jobs.batch.volcano.sh",
            object_name=platform_check_name(config), object_namespace=config.jobs.namespace,
            json_path='.status.conditions[?(@.status=="Completed")].status', timeout=Duration.minutes(15))
        completed.node.add_dependency(job)
        CfnOutput(self, "PlatformCheck", value=completed.value,
                  description="A job ran through Volcano and reached etcd after this deploy")


