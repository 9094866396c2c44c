"""EKS add-ons the platform needs, each with the least IAM it can run with, through Pod Identity."""

from __future__ import annotations

import json
from dataclasses import dataclass

from aws_cdk import aws_eks_v2 as eks, aws_iam as iam
from constructs import Construct

from cdk_constructs.nag import acknowledge
from cdk_constructs.pod_identity import PodIdentityRole
from config.versions import addon_version

# Tolerate every taint: the FSx node plugin must run exactly on the tainted GPU and Neuron
# nodes that mount the file system, and the agents must report from them.
TOLERATE_ALL = [{"operator": "Exists"}]


@dataclass(frozen=True)
class ClusterAddonsProps:
    cluster: eks.Cluster
    kubernetes_version: str
    versions: dict[str, str]  # add-on name -> pinned version (config); else config/versions.py, else EKS's default
    file_system_arn: str
    monitoring: bool
    node_monitoring_agent: bool = True


class ClusterAddons(Construct):
    def __init__(self, scope: Construct, id: str, props: ClusterAddonsProps) -> None:
        super().__init__(scope, id)
        self._props = props
        self.pod_identity_agent = self._addon("eks-pod-identity-agent")
        cni = self._role("VpcCni", "kube-system", "aws-node", "VPC CNI: assigns pod IP addresses",
                         managed=["AmazonEKS_CNI_Policy"])
        # Node groups wait for it: nodes must come up with the pinned CNI (EFA-only interfaces need it).
        # Its network policy agent enforces the platform's NetworkPolicies (etcd's, the jobs'); off
        # by default, and a string, not a boolean (EKS user guide, cni-network-policy-configure;
        # VPC CNI 1.14+, which every pinned version is).
        self.vpc_cni = self._addon("vpc-cni", roles=[cni], configuration={"enableNetworkPolicy": "true"})
        self._addon("kube-proxy")
        self._addon("coredns")
        # gp3 volumes for etcd's data (the platform's StorageClass names this driver).
        ebs = self._role("EbsCsi", "kube-system", "ebs-csi-controller-sa",
                         "EBS CSI driver: creates and attaches the platform's gp3 volumes",
                         managed=["service-role/AmazonEBSCSIDriverPolicy"])
        self.ebs_csi = self._addon("aws-ebs-csi-driver", roles=[ebs])
        fsx = self._role("FsxCsi", "kube-system", "fsx-csi-controller-sa",
                         "FSx CSI driver: the file system is bound statically; the driver only describes it")
        fsx.role.add_to_policy(iam.PolicyStatement(actions=["fsx:DescribeFileSystems"],
                                                   resources=[props.file_system_arn]))
        self.fsx_csi = self._addon("aws-fsx-csi-driver", roles=[fsx], configuration={
            "node": {"tolerations": TOLERATE_ALL}})
        self.node_monitoring: eks.CfnAddon | None = None
        if props.node_monitoring_agent:
            # Reports NodeConditions (AcceleratedHardwareReady: NVIDIA XIDs and DCGM health, Neuron
            # hardware errors; KernelReady, NetworkingReady, StorageReady) that the node groups' auto repair
            # acts on. It calls only the Kubernetes API and IMDS: no IAM role (EKS User Guide,
            # workloads-add-ons-available-eks, "doesn't require additional permissions"). Its agent
            # tolerates every taint; its DCGM host engine, which the agent reads GPU health from, tolerates
            # none (aws/eks-node-monitoring-agent v1.7.0, charts/.../values.yaml ``dcgmAgent.tolerations: []``):
            # without this it never runs on the tainted GPU nodes and XIDs go unseen.
            self.node_monitoring = self._addon("eks-node-monitoring-agent", configuration={
                "dcgmAgent": {"tolerations": TOLERATE_ALL}})
        self.observability: eks.CfnAddon | None = None
        if props.monitoring:
            agent = self._role("CloudWatchAgent", "amazon-cloudwatch", "cloudwatch-agent",
                               "CloudWatch agent: Container Insights with GPU, Neuron and EFA metrics",
                               managed=["CloudWatchAgentServerPolicy"])
            self.observability = self._addon("amazon-cloudwatch-observability", roles=[agent], configuration={
                "tolerations": TOLERATE_ALL,
                "agent": {"config": {"logs": {"metrics_collected": {"kubernetes": {
                    "enhanced_container_insights": True, "accelerated_compute_metrics": True}}}}},
            })

    def _role(self, id: str, namespace: str, service_account: str, description: str,
              managed: list[str] = ()) -> PodIdentityRole:
        role = PodIdentityRole(self, id, cluster=self._props.cluster, namespace=namespace,
                               service_account=service_account, description=description, associate_now=False)
        for name in managed:
            role.role.add_managed_policy(iam.ManagedPolicy.from_aws_managed_policy_name(name))
            acknowledge(role.role, "IAM4", f"{name} is the AWS-maintained policy this add-on documents; "
                        "its actions follow the add-on's releases",
                        finding=f"Policy::arn:<AWS::Partition>:iam::aws:policy/{name}")
        return role

    def _addon(self, name: str, roles: list[PodIdentityRole] = (), configuration: dict | None = None) -> eks.CfnAddon:
        addon = eks.CfnAddon(
            self, name,
            addon_name=name,
            cluster_name=self._props.cluster.cluster_name,
            addon_version=addon_version(self._props.kubernetes_version, name, self._props.versions),
            # The platform owns these settings; an upgrade overwrites hand edits.
            resolve_conflicts="OVERWRITE",
            configuration_values=json.dumps(configuration) if configuration else None,
            pod_identity_associations=[eks.CfnAddon.PodIdentityAssociationProperty(
                role_arn=r.role.role_arn, service_account=r.service_account) for r in roles] or None,
        )
        if roles:
            addon.node.add_dependency(self.pod_identity_agent)
        return addon


