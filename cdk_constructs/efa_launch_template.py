"""A launch template for accelerated nodes (EKS, or AWS Batch): one EFA interface per network card, IMDSv2, encrypted gp3.

The interface layout follows EC2's rules for multi-card instances: card 0 carries the
primary interface (an EFA with its ENA device, device index 0). Every other card carries one
interface: an EFA-only interface at device index 0 on the types whose secondary cards take them
(p5, p5e, p5en, trn2: EC2 User Guide, "Maximize network bandwidth on Amazon EC2 instances with
multiple network cards"), which has no IP address and so takes none from the subnet; elsewhere
an EFA at device index 1. Each interface lists its security groups in ``Groups``. This replaces
the group EKS would attach by itself, so the cluster security group is listed too.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Fn, aws_ec2 as ec2
from constructs import Construct

from config.catalog import InstanceType

ROOT_DEVICE = "/dev/xvda"  # AL2023 EKS AMIs


L = ec2.CfnLaunchTemplate


def efa_interfaces(count: int, security_group_ids: list[str], efa_only_secondary: bool = False
                   ) -> list[L.NetworkInterfaceProperty]:
    """``count`` EFA interfaces, one per network card."""
    def interface(card: int) -> L.NetworkInterfaceProperty:
        efa_only = card > 0 and efa_only_secondary
        return L.NetworkInterfaceProperty(
            network_card_index=card,
            device_index=0 if card == 0 or efa_only else 1,
            interface_type="efa-only" if efa_only else "efa",
            delete_on_termination=True,
            groups=security_group_ids,
        )

    return [interface(card) for card in range(count)]


@dataclass(frozen=True)
class CapacityReservation:
    """Launch into reserved capacity: a Capacity Block for ML or an On-Demand Capacity Reservation."""

    reservation_id: str
    capacity_block: bool


@dataclass(frozen=True)
class EfaLaunchTemplateProps:
    instance: InstanceType
    efa: bool
    security_group_ids: list[str]  # the node group (EFA) and the EKS cluster security groups
    placement_group_name: str | None
    root_volume_gib: int = 200  # CUDA / Neuron images are large
    efa_only_secondary: bool = False
    capacity_reservation: CapacityReservation | None = None
    user_data: str | None = None  # MIME multipart (EKS merges its own part; Batch adds the ECS one)


class EfaLaunchTemplate(Construct):
    """The launch template an accelerated managed node group is built from (no AMI: EKS picks it)."""

    def __init__(self, scope: Construct, id: str, props: EfaLaunchTemplateProps) -> None:
        super().__init__(scope, id)
        self.efa_interfaces = props.instance.efa_interfaces if props.efa else 0
        data = L.LaunchTemplateDataProperty(
            # The node group leaves the type to the template: CDK's Nodegroup check rejects
            # the Neuron AMI type for trn1 given as a node group instance type.
            instance_type=props.instance.name,
            # IMDSv2 only; hop limit 2 so pods on the node network can still reach it through the CNI.
            metadata_options=L.MetadataOptionsProperty(
                http_tokens="required", http_put_response_hop_limit=2, http_endpoint="enabled"),
            block_device_mappings=[L.BlockDeviceMappingProperty(
                device_name=ROOT_DEVICE,
                ebs=L.EbsProperty(volume_size=props.root_volume_gib, volume_type="gp3", encrypted=True,
                                  delete_on_termination=True))],
            # Without EFA, EKS creates the interfaces itself and the groups go on the template.
            network_interfaces=efa_interfaces(self.efa_interfaces, props.security_group_ids,
                                              props.efa_only_secondary) or None,
            security_group_ids=None if self.efa_interfaces else props.security_group_ids,
            placement=L.PlacementProperty(group_name=props.placement_group_name)
            if props.placement_group_name else None,
            user_data=Fn.base64(props.user_data) if props.user_data else None,
            **_reserved(props.capacity_reservation),
        )
        self.resource = L(self, "Resource", launch_template_data=data)

    @property
    def launch_template_id(self) -> str:
        return self.resource.ref

    @property
    def version(self) -> str:
        return self.resource.attr_latest_version_number


def _reserved(reservation: CapacityReservation | None) -> dict:
    """Launch template fields that target a reservation (EKS User Guide, "Capacity Blocks for ML")."""
    if reservation is None:
        return {}
    fields = {"capacity_reservation_specification": L.CapacityReservationSpecificationProperty(
        capacity_reservation_target=L.CapacityReservationTargetProperty(
            capacity_reservation_id=reservation.reservation_id))}
    if reservation.capacity_block:
        fields["instance_market_options"] = L.InstanceMarketOptionsProperty(market_type="capacity-block")
    return fields
