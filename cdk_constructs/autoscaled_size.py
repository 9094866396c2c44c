"""A node group's desired size that does not fight cluster-autoscaler after the group is created.

See ``autoscaled_size_handler.py`` for why: the template's desired size is the group's current
one (clamped to min and max) on every deploy, and ``initial_size`` only when it is created.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aws_cdk import (
    CustomResource, Duration, RemovalPolicy, Stack, Token, aws_eks_v2 as eks, aws_iam as iam, aws_lambda as lambda_,
    aws_logs as logs,
)
from constructs import Construct

from cdk_constructs.nag import account_in_finding, acknowledge

HANDLER_SOURCE = Path(__file__).with_name("autoscaled_size_handler.py")
# One function per stack serves every node group.
_FUNCTION_UUID = "4f1e7a52-autoscaled-size-handler"


@dataclass(frozen=True)
class AutoscaledSizeProps:
    cluster: eks.ICluster
    label_key: str  # a label only this node group's nodes carry
    label_value: str
    min_size: int
    max_size: int
    initial_size: int
    # Anything whose change makes CloudFormation update the node group (its launch template version).
    generation: str = ""


class AutoscaledSize(Construct):
    def __init__(self, scope: Construct, id: str, props: AutoscaledSizeProps) -> None:
        super().__init__(scope, id)
        function = _function(self, props.cluster)
        self.resource = CustomResource(self, "Resource", service_token=function.function_arn,
                                       resource_type="Custom::NodegroupDesiredSize", properties={
                                           "ClusterName": props.cluster.cluster_name, "LabelKey": props.label_key,
                                           "LabelValue": props.label_value, "MinSize": props.min_size,
                                           "MaxSize": props.max_size, "InitialSize": props.initial_size,
                                           "Generation": props.generation,
                                       })

    @property
    def desired_size(self) -> int:
        """The size to give the node group: a number token resolved at deploy time."""
        return Token.as_number(self.resource.get_att("DesiredSize"))


def _function(scope: Construct, cluster: eks.ICluster) -> lambda_.SingletonFunction:
    stack = Stack.of(scope)
    existing = stack.node.try_find_child("NodegroupDesiredSize")
    if existing is not None:
        return existing  # type: ignore[return-value]
    log_group = logs.LogGroup(stack, "NodegroupDesiredSizeLogs", retention=logs.RetentionDays.THREE_MONTHS,
                              removal_policy=RemovalPolicy.DESTROY)
    role = iam.Role(stack, "NodegroupDesiredSizeRole", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
                    description="Reads the current desired size of this cluster's node groups")
    log_group.grant_write(role)
    role.add_to_policy(iam.PolicyStatement(actions=["eks:ListNodegroups"], resources=[cluster.cluster_arn]))
    role.add_to_policy(iam.PolicyStatement(actions=["eks:DescribeNodegroup"], resources=[stack.format_arn(
        service="eks", resource="nodegroup", resource_name=f"{cluster.cluster_name}/*/*")]))
    function = lambda_.SingletonFunction(
        stack, "NodegroupDesiredSize", uuid=_FUNCTION_UUID, lambda_purpose="NodegroupDesiredSize",
        runtime=lambda_.Runtime.PYTHON_3_14, handler="index.handler",
        code=lambda_.Code.from_inline(HANDLER_SOURCE.read_text()), timeout=Duration.minutes(2),
        role=role, log_group=log_group, description="Keeps cluster-autoscaler's node counts across deploys",
    )
    cluster_id = stack.get_logical_id(cluster.node.default_child)
    acknowledge(role, "IAM5", "Node group names carry a random suffix EKS chooses; the ARN pattern is limited to "
                "this cluster's node groups", finding=f"Resource::arn:{_partition(stack)}:eks:{stack.region}:"
                f"{account_in_finding(stack)}:nodegroup/<{cluster_id}>/*/*")
    acknowledge(role, "IAM5", "CDK's write grant on the function's own log group (its streams)",
                finding=f"Resource::<{stack.get_logical_id(log_group.node.default_child)}.Arn>:*")
    return function


def _partition(stack: Stack) -> str:
    return "<AWS::Partition>" if Token.is_unresolved(stack.partition) else stack.partition
