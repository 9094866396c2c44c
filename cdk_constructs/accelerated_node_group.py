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
from config import AcceleratedNodeGroupConfig
from config.catalog import (
    ACCELERATED_ROLE, ACCELERATOR_LABEL, EFA_PRESENT_LABEL, GPU_TYPE_LABEL, INSTANCE_TYPE_LABEL, NODE_GROUP_LABEL,
    NODE_ROLE_LABEL,
)

CA_TEMPLATE = "k8s.io/cluster-autoscaler/node-template"


def node_labels(group: AcceleratedNodeGroupConfig) -> dict[str, str]:
    """Labels every node of the group carries (device plugins and jobs select on them)."""
    instance = group.instance
    labels = {
        NODE_ROLE_LABEL: ACCELERATED_ROLE,
        ACCELERATOR_LABEL: instance.accelerator.value,
        NODE_GROUP_LABEL: group.name,
        EFA_PRESENT_LABEL: "true" if group.efa_enabled else "false",
    }
    if instance.gpu_type:
        labels[GPU_TYPE_LABEL] = instance.gpu_type
    return labels


def node_taint(group: AcceleratedNodeGroupConfig) -> tuple[str, str, str]:
    """(key, value, effect): only pods that tolerate the accelerator land on these nodes."""
    return group.instance.taint_key, "true", "NoSchedule"


def autoscaler_template_tags(group: AcceleratedNodeGroupConfig) -> dict[str, str]:
    """The Auto Scaling group tags cluster-autoscaler reads to model a node of an empty group."""
    instance = group.instance
    tags = {f"{CA_TEMPLATE}/resources/{instance.accelerator_resource}": str(instance.accelerator_count)}
    if group.efa_enabled:
        tags[f"{CA_TEMPLATE}/resources/{instance.efa_resource}"] = str(instance.efa_interfaces)
    labels = {**node_labels(group), INSTANCE_TYPE_LABEL: instance.name}
    tags.update({f"{CA_TEMPLATE}/label/{key}": value for key, value in labels.items()})
    key, value, effect = node_taint(group)
    tags[f"{CA_TEMPLATE}/taint/{key}"] = f"{value}:{effect}"
    return tags


@dataclass(frozen=True)
class AcceleratedNodeGroupProps:
    cluster: eks.ICluster
    group: AcceleratedNodeGroupConfig
    subnet: ec2.ISubnet  # the compute subnet, shared with FSx for Lustre
    node_role: iam.IRole
    node_security_group: ec2.ISecurityGroup


class AcceleratedNodeGroup(Construct):
    def __init__(self, scope: Construct, id: str, props: AcceleratedNodeGroupProps) -> None:
        super().__init__(scope, id)
        group, instance = props.group, props.group.instance
        placement_name = None
        if group.placement_group:
            placement = ec2.CfnPlacementGroup(self, "PlacementGroup", strategy="cluster")
            placement_name = placement.ref
        reservation = group.capacity_reservation
        self.launch_template = EfaLaunchTemplate(self, "LaunchTemplate", EfaLaunchTemplateProps(
            instance=instance,
            efa=group.efa_enabled,
            security_group_ids=[props.node_security_group.security_group_id,
                                props.cluster.cluster_security_group_id],
            placement_group_name=placement_name,
            efa_only_secondary=group.efa_only_interfaces,
            capacity_reservation=CapacityReservation(reservation.id, reservation.kind == "capacity_block")
            if reservation else None,
        ))
        size = AutoscaledSize(self, "DesiredSize", AutoscaledSizeProps(
            cluster=props.cluster, label_key=NODE_GROUP_LABEL, label_value=group.name,
            min_size=group.min_size, max_size=group.max_size, initial_size=group.desired_size,
            generation=self.launch_template.version))
        key, value, _ = node_taint(group)
        capacity = "CAPACITY_BLOCK" if reservation and reservation.kind == "capacity_block" else group.capacity_type.value
        self.nodegroup = eks.Nodegroup(
            self, "Nodegroup",
            cluster=props.cluster,
            ami_type=eks.NodegroupAmiType[instance.ami_type.upper()],
            capacity_type=eks.CapacityType[capacity],
            launch_template_spec=eks.LaunchTemplateSpec(
                id=self.launch_template.launch_template_id, version=self.launch_template.version),
            subnets=ec2.SubnetSelection(subnets=[props.subnet]),
            node_role=props.node_role,
            min_size=group.min_size, desired_size=size.desired_size, max_size=group.max_size,
            labels=node_labels(group),
            taints=[eks.TaintSpec(key=key, value=value, effect=eks.TaintEffect.NO_SCHEDULE)],
        )
        self._tag_auto_scaling_group(props.cluster, autoscaler_template_tags(group))

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
