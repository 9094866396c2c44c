"""An EKS managed node group of GPU or Trainium nodes: EFA launch template, placement group, one subnet.

Scale from zero: cluster-autoscaler learns what a node of an empty group would offer from
tags on the group's Auto Scaling group (``k8s.io/cluster-autoscaler/node-template/...``).
EKS managed node groups do not copy their tags to the Auto Scaling group, and EKS's own
node-group description has labels and taints but no extended resources. Without the tags,
a pod asking for ``vpc.amazonaws.com/efa`` or ``aws.amazon.com/neuron`` never makes a group
at zero grow. A custom resource looks up the group's Auto Scaling group after it exists and
writes the tags.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import ArnFormat, Stack, aws_ec2 as ec2, aws_eks_v2 as eks, aws_iam as iam, custom_resources as cr
from constructs import Construct

from cdk_constructs.autoscaled_size import AutoscaledSize, AutoscaledSizeProps
from cdk_constructs.efa_launch_template import CapacityReservation, EfaLaunchTemplate, EfaLaunchTemplateProps
from cdk_constructs.nag import account_in_finding, acknowledge
from cdk_constructs.node_version import NodeVersion, pin_node_version
from config.catalog import (
    ACCELERATED_ROLE, ACCELERATOR_LABEL, EFA_PRESENT_LABEL, GPU_TYPE_LABEL, INSTANCE_TYPE_LABEL, NODE_GROUP_LABEL,
    NODE_ROLE_LABEL, InstanceType,
)
from training.contract import ACCELERATOR_TAINT_EFFECT, NODE_CHECK_TAINT, NODE_CHECK_TAINT_VALUE

CA_TEMPLATE = "k8s.io/cluster-autoscaler/node-template"


def node_labels(name: str, instance: InstanceType, efa: bool) -> dict[str, str]:
    """Labels every node of group ``name`` carries (device plugins and jobs select on them)."""
    labels = {
        NODE_ROLE_LABEL: ACCELERATED_ROLE,
        ACCELERATOR_LABEL: instance.accelerator.value,
        NODE_GROUP_LABEL: name,
        EFA_PRESENT_LABEL: "true" if efa else "false",
    }
    if instance.gpu_type:
        labels[GPU_TYPE_LABEL] = instance.gpu_type
    return labels


def node_taint(instance: InstanceType) -> tuple[str, str, str]:
    """(key, value, effect): only pods that tolerate the accelerator land on these nodes."""
    return instance.taint_key, "true", ACCELERATOR_TAINT_EFFECT


def autoscaler_template_tags(name: str, instance: InstanceType, efa: bool) -> dict[str, str]:
    """The Auto Scaling group tags cluster-autoscaler reads to model a node of an empty group."""
    tags = {f"{CA_TEMPLATE}/resources/{instance.accelerator_resource}": str(instance.accelerator_count)}
    if efa:
        tags[f"{CA_TEMPLATE}/resources/{instance.efa_resource}"] = str(instance.efa_interfaces)
    labels = {**node_labels(name, instance, efa), INSTANCE_TYPE_LABEL: instance.name}
    tags.update({f"{CA_TEMPLATE}/label/{key}": value for key, value in labels.items()})
    key, value, effect = node_taint(instance)
    tags[f"{CA_TEMPLATE}/taint/{key}"] = f"{value}:{effect}"
    return tags


@dataclass(frozen=True)
class AcceleratedNodeGroupProps:
    cluster: eks.ICluster
    subnet: ec2.ISubnet  # the compute subnet, shared with FSx for Lustre
    node_role: iam.IRole
    node_security_group: ec2.ISecurityGroup  # EFA among the nodes, Lustre to the file system
    name: str  # the nodes' group label: jobs, AutoscaledSize and cluster-autoscaler's template find them by it
    instance: InstanceType  # the catalog's entry: launch template, AMI type, labels, taint, template tags
    min_size: int
    max_size: int
    desired_size: int  # when the group is created; cluster-autoscaler owns it afterwards (AutoscaledSize)
    efa: bool  # one EFA interface per network card (the instance must have EFA)
    version: NodeVersion  # the Kubernetes minor (and AMI release) the nodes run, from the cluster's config
    capacity_type: eks.CapacityType = eks.CapacityType.ON_DEMAND  # ON_DEMAND or SPOT
    placement_group: bool = True  # a cluster placement group of the group's own
    # Launch into reserved capacity; a Capacity Block makes the group's capacity type CAPACITY_BLOCK.
    capacity_reservation: CapacityReservation | None = None
    # EKS node auto repair: a node reported unhealthy (NodeConditions of the node monitoring agent, or
    # NotReady) is rebooted or replaced by the managed node group.
    auto_repair: bool = True
    # Nodes register with the node check's taint (contract.NODE_CHECK_TAINT): no job lands before the
    # platform's check passed them (k8s_charts/node_check.py).
    node_check: bool = True


class AcceleratedNodeGroup(Construct):
    def __init__(self, scope: Construct, id: str, props: AcceleratedNodeGroupProps) -> None:
        super().__init__(scope, id)
        instance, reservation = props.instance, props.capacity_reservation
        placement_name = None
        if props.placement_group:
            placement = ec2.CfnPlacementGroup(self, "PlacementGroup", strategy="cluster")
            placement_name = placement.ref
        self.launch_template = EfaLaunchTemplate(self, "LaunchTemplate", EfaLaunchTemplateProps(
            instance=instance,
            efa=props.efa,
            security_group_ids=[props.node_security_group.security_group_id,
                                props.cluster.cluster_security_group_id],
            placement_group_name=placement_name,
            efa_only_secondary=props.efa and instance.efa_only_secondary,
            capacity_reservation=reservation,
        ))
        size = AutoscaledSize(self, "DesiredSize", AutoscaledSizeProps(
            cluster=props.cluster, label_key=NODE_GROUP_LABEL, label_value=props.name,
            min_size=props.min_size, max_size=props.max_size, initial_size=props.desired_size,
            generation=self.launch_template.version))
        key, value, _ = node_taint(instance)
        block = reservation is not None and reservation.capacity_block
        capacity = eks.CapacityType.CAPACITY_BLOCK if block else props.capacity_type
        self.nodegroup = eks.Nodegroup(
            self, "Nodegroup",
            cluster=props.cluster,
            ami_type=eks.NodegroupAmiType[instance.ami_type.upper()],
            capacity_type=capacity,
            launch_template_spec=eks.LaunchTemplateSpec(
                id=self.launch_template.launch_template_id, version=self.launch_template.version),
            subnets=ec2.SubnetSelection(subnets=[props.subnet]),
            node_role=props.node_role,
            min_size=props.min_size, desired_size=size.desired_size, max_size=props.max_size,
            labels=node_labels(props.name, instance, props.efa),
            taints=[eks.TaintSpec(key=key, value=value, effect=eks.TaintEffect.NO_SCHEDULE),
                    *([eks.TaintSpec(key=NODE_CHECK_TAINT, value=NODE_CHECK_TAINT_VALUE,
                                     effect=eks.TaintEffect.NO_SCHEDULE)] if props.node_check else [])],
            # NodeRepairConfig.Enabled, with EKS's own thresholds and actions (a node whose accelerators are
            # reported unhealthy is rebooted or replaced after 10 minutes, one NotReady for 30 is replaced).
            enable_node_auto_repair=props.auto_repair,
        )
        if not props.auto_repair:
            # The L2 renders no NodeRepairConfig at all for false (aws-cdk-lib 2.275.0,
            # aws-eks-v2/lib/managed-nodegroup.js): turning repair off must say so to EKS.
            self.nodegroup.node.default_child.add_property_override("NodeRepairConfig", {"Enabled": False})
        pin_node_version(self.nodegroup, props.version)
        self._tag_auto_scaling_group(props.cluster, autoscaler_template_tags(props.name, instance, props.efa))

    def _tag_auto_scaling_group(self, cluster: eks.ICluster, tags: dict[str, str]) -> None:
        stack = Stack.of(self)
        nodegroup_name = self.nodegroup.nodegroup_name
        describe = cr.AwsSdkCall(
            service="EKS", action="describeNodegroup",
            parameters={"clusterName": cluster.cluster_name, "nodegroupName": nodegroup_name},
            output_paths=["nodegroup.resources.autoScalingGroups.0.name"],
            physical_resource_id=cr.PhysicalResourceId.of(f"{nodegroup_name}-asg"),
        )
        lookup = cr.AwsCustomResource(
            self, "FindAutoScalingGroup", on_create=describe, on_update=describe,
            policy=cr.AwsCustomResourcePolicy.from_statements([iam.PolicyStatement(
                actions=["eks:DescribeNodegroup"], resources=[self.nodegroup.nodegroup_arn])]),
            install_latest_aws_sdk=False,
        )
        asg_name = lookup.get_response_field("nodegroup.resources.autoScalingGroups.0.name")
        tag = cr.AwsSdkCall(
            service="AutoScaling", action="createOrUpdateTags",
            parameters={"Tags": [{"ResourceId": asg_name, "ResourceType": "auto-scaling-group", "Key": key,
                                  "Value": value, "PropagateAtLaunch": False} for key, value in sorted(tags.items())]},
            physical_resource_id=cr.PhysicalResourceId.of(f"{nodegroup_name}-asg-tags"),
        )
        tagger = cr.AwsCustomResource(
            self, "TagAutoScalingGroup", on_create=tag, on_update=tag,
            policy=cr.AwsCustomResourcePolicy.from_statements([iam.PolicyStatement(
                actions=["autoscaling:CreateOrUpdateTags"],
                # Managed node groups name their group eks-<node group name>-<id> and tag it with the cluster.
                resources=[stack.format_arn(service="autoscaling", resource="autoScalingGroup",
                                            resource_name=f"*:autoScalingGroupName/eks-{nodegroup_name}-*",
                                            arn_format=ArnFormat.COLON_RESOURCE_NAME)],
                conditions={"StringEquals": {"autoscaling:ResourceTag/eks:cluster-name": cluster.cluster_name}},
            )]),
            install_latest_aws_sdk=False,
        )
        logical_id = stack.get_logical_id(self.nodegroup.node.default_child)
        acknowledge(tagger, "IAM5",
                    "Managed node groups name their Auto Scaling group eks-<node group>-<random id>; the random "
                    "part is unknown until deploy, and a tag condition pins the group to this cluster",
                    finding=f"Resource::arn:aws:autoscaling:{stack.region}:{account_in_finding(self)}:autoScalingGroup:*"
                            f":autoScalingGroupName/eks-<{logical_id}.NodegroupName>-*")
