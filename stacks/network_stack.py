"""Network stack: the training VPC and its single compute subnet."""

from __future__ import annotations

from aws_cdk import CfnOutput, Stack
from constructs import Construct

from cdk_constructs.network import TrainingNetwork, TrainingNetworkProps
from config import PlatformConfig


class NetworkStack(Stack):
    """Owns the VPC. Later stacks take ``network.compute_subnet`` rather than choosing subnets."""

    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        net = config.network
        self.network = TrainingNetwork(
            self,
            "Network",
            TrainingNetworkProps(
                vpc_cidr=net.vpc_cidr,
                compute_az=config.compute_az,
                second_az=config.control_plane_az,
                nat_gateways=net.nat_gateways,
                interface_endpoints=net.interface_endpoints,
                flow_logs_retention_days=net.flow_logs_retention_days,
            ),
        )
        CfnOutput(self, "VpcId", value=self.network.vpc.vpc_id)
        CfnOutput(
            self,
            "ComputeSubnetId",
            value=self.network.compute_subnet.subnet_id,
            description=f"The one subnet ({config.compute_az}) for accelerated nodes and FSx for Lustre",
        )
        CfnOutput(
            self,
            "NodeSecurityGroupId",
            value=self.network.node_security_group.security_group_id,
            description="Attached to every worker node; FSx for Lustre admits its clients by this group",
        )
