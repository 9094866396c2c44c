"""A training VPC: two AZs for EKS, one private compute subnet for nodes and FSx."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from aws_cdk import RemovalPolicy, aws_ec2 as ec2, aws_logs as logs
from constructs import Construct

PUBLIC_GROUP = "public"
PRIVATE_GROUP = "private"

# The endpoints private nodes need to pull images, assume roles and ship logs without NAT.
INTERFACE_ENDPOINTS = {
    "EcrApi": ec2.InterfaceVpcEndpointAwsService.ECR,
    "EcrDocker": ec2.InterfaceVpcEndpointAwsService.ECR_DOCKER,
    "Sts": ec2.InterfaceVpcEndpointAwsService.STS,
    "Logs": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS,
    "Ec2": ec2.InterfaceVpcEndpointAwsService.EC2,
}

R = logs.RetentionDays
RETENTION_BY_DAYS = {
    1: R.ONE_DAY, 3: R.THREE_DAYS, 5: R.FIVE_DAYS, 7: R.ONE_WEEK, 14: R.TWO_WEEKS, 30: R.ONE_MONTH,
    60: R.TWO_MONTHS, 90: R.THREE_MONTHS, 120: R.FOUR_MONTHS, 150: R.FIVE_MONTHS, 180: R.SIX_MONTHS,
    365: R.ONE_YEAR, 400: R.THIRTEEN_MONTHS, 545: R.EIGHTEEN_MONTHS, 731: R.TWO_YEARS, 1096: R.THREE_YEARS,
    1827: R.FIVE_YEARS, 2192: R.SIX_YEARS, 2557: R.SEVEN_YEARS, 2922: R.EIGHT_YEARS, 3288: R.NINE_YEARS,
    3653: R.TEN_YEARS,
}


@dataclass(frozen=True)
class TrainingNetworkProps:
    vpc_cidr: str
    compute_az: str
    second_az: str
    nat_gateways: int = 1
    interface_endpoints: bool = True
    flow_logs_retention_days: int = 90


class TrainingNetwork(Construct):
    """VPC with public and private subnets in two AZs.

    ``compute_subnet`` is the single private subnet in the compute AZ: accelerated node
    groups and the FSx file system must use it and nothing else.

    ``node_security_group`` goes on every worker node (system and accelerated). It admits
    all traffic from itself in both directions, which EFA requires, and it is the group
    the file system trusts. Nodes get their general egress from the EKS cluster security
    group they also carry.
    """

    def __init__(self, scope: Construct, id: str, props: TrainingNetworkProps) -> None:
        super().__init__(scope, id)
        prefix = ipaddress.IPv4Network(props.vpc_cidr).prefixlen
        # Pods take VPC addresses (VPC CNI), so private subnets get most of the range.
        private_type = (
            ec2.SubnetType.PRIVATE_WITH_EGRESS if props.nat_gateways else ec2.SubnetType.PRIVATE_ISOLATED
        )
        self.vpc = ec2.Vpc(
            self,
            "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(props.vpc_cidr),
            availability_zones=[props.compute_az, props.second_az],
            nat_gateways=props.nat_gateways,
            subnet_configuration=[
                ec2.SubnetConfiguration(name=PUBLIC_GROUP, subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=prefix + 6),
                ec2.SubnetConfiguration(name=PRIVATE_GROUP, subnet_type=private_type, cidr_mask=prefix + 2),
            ],
            gateway_endpoints={"S3": ec2.GatewayVpcEndpointOptions(service=ec2.GatewayVpcEndpointAwsService.S3)},
        )
        flow_log_group = logs.LogGroup(
            self,
            "FlowLogs",
            retention=RETENTION_BY_DAYS[props.flow_logs_retention_days],
            removal_policy=RemovalPolicy.RETAIN,
        )
        self.vpc.add_flow_log(
            "FlowLog", destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_log_group)
        )
        if props.interface_endpoints:
            # One group, HTTPS from the VPC's own literal range, instead of an ingress rule per
            # endpoint that refers to the CIDR through an intrinsic nobody can review.
            endpoint_sg = ec2.SecurityGroup(
                self,
                "EndpointSecurityGroup",
                vpc=self.vpc,
                description="HTTPS from inside the VPC to its interface endpoints",
                allow_all_outbound=False,
            )
            endpoint_sg.add_ingress_rule(ec2.Peer.ipv4(props.vpc_cidr), ec2.Port.tcp(443), "HTTPS from the VPC")
            private = ec2.SubnetSelection(subnet_group_name=PRIVATE_GROUP)
            for name, service in INTERFACE_ENDPOINTS.items():
                self.vpc.add_interface_endpoint(
                    name, service=service, subnets=private, private_dns_enabled=True,
                    security_groups=[endpoint_sg], open=False,
                )

        self.node_security_group = ec2.SecurityGroup(
            self,
            "NodeSecurityGroup",
            vpc=self.vpc,
            description="Worker nodes: all traffic among themselves (EFA), and the Lustre clients FSx trusts",
            # With allow_all_outbound=True CDK silently drops the self egress rule EFA needs.
            allow_all_outbound=False,
        )
        self.node_security_group.connections.allow_internally(ec2.Port.all_traffic(), "EFA and node-to-node")

        compute = self.vpc.select_subnets(subnet_group_name=PRIVATE_GROUP, availability_zones=[props.compute_az])
        if len(compute.subnets) != 1:
            raise ValueError(f"expected one private subnet in {props.compute_az}, found {len(compute.subnets)}")
        self.compute_subnet: ec2.ISubnet = compute.subnets[0]
        # Both AZs' private subnets: the EKS control plane's and the system nodes'.
        self.private_subnets = ec2.SubnetSelection(subnet_group_name=PRIVATE_GROUP)

