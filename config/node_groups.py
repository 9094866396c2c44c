"""The platform config's node groups: the system group and the accelerated (GPU, Trainium) ones."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field, field_validator, model_validator

from config.catalog import CATALOG, InstanceType, accelerated_types, cpu_types, lookup
from training.contract import ETCD_MEMBERS
from typed_config import FieldProblem, StrictModel
from config.fields import (
    Name,
)


class CapacityType(str, Enum):
    ON_DEMAND = "ON_DEMAND"
    SPOT = "SPOT"


# Amazon EKS service quotas (User Guide, "Amazon EKS service quotas"): nodes per managed node
# group, default 450. A larger max_size is a typo, or needs a quota increase first.
MAX_NODES_PER_GROUP = 450


class _Sized(StrictModel):
    """A node group's sizes; every subclass gets the min <= desired <= max rule.

    ``desired_size`` is the size a group is created with. After that cluster-autoscaler owns
    the number of nodes: a later deploy keeps whatever it chose, clamped to min and max
    (cdk_constructs/autoscaled_size.py).
    """

    min_size: int = Field(ge=0)
    desired_size: int = Field(ge=0)
    max_size: int = Field(ge=1)

    @model_validator(mode="after")
    def _sizes_in_order(self):
        if self.max_size > MAX_NODES_PER_GROUP:
            raise FieldProblem("max_size", self.max_size, f"1 to {MAX_NODES_PER_GROUP}",
                               f"EKS's quota 'Nodes per managed node group' is {MAX_NODES_PER_GROUP} unless raised")
        if self.min_size > self.desired_size:
            raise FieldProblem(
                "min_size", self.min_size, f"at most desired_size ({self.desired_size})", "min_size exceeds desired_size"
            )
        if self.desired_size > self.max_size:
            raise FieldProblem(
                "desired_size", self.desired_size, f"at most max_size ({self.max_size})", "desired_size exceeds max_size"
            )
        return self


class SystemNodeGroupConfig(_Sized):
    """CPU nodes for etcd, Volcano, the autoscaler and other controllers."""

    instance_type: str = "c5.2xlarge"
    # Three at least: etcd's three members each need a node of their own (k8s_charts/platform_charts.py).
    min_size: int = Field(default=3, ge=1)
    desired_size: int = Field(default=3, ge=1)
    max_size: int = Field(default=4, ge=1)

    @field_validator("min_size")
    @classmethod
    def _room_for_etcd(cls, v: int) -> int:
        if v < ETCD_MEMBERS:
            raise FieldProblem("", v, f"at least {ETCD_MEMBERS}",
                               f"etcd's {ETCD_MEMBERS} members each need a system node of their own")
        return v

    @field_validator("instance_type")
    @classmethod
    def _cpu_type(cls, v: str) -> str:
        if v not in CATALOG or CATALOG[v].is_accelerated:
            raise FieldProblem("", v, ", ".join(cpu_types()), "not a CPU instance type in the catalog")
        return v

    @property
    def instance(self) -> InstanceType:
        return lookup(self.instance_type)


class CapacityReservationConfig(StrictModel):
    """Capacity bought ahead: an EC2 Capacity Block for ML, or an On-Demand Capacity Reservation."""

    kind: Literal["capacity_block", "on_demand"]
    id: str = Field(pattern=r"^cr-[0-9a-f]{17}$")


class AcceleratedNodeGroupConfig(_Sized):
    """One managed node group of GPU or Trainium nodes, in the compute subnet."""

    name: Name
    instance_type: str
    capacity_type: CapacityType = CapacityType.ON_DEMAND
    efa: bool | None = None  # None: on wherever the instance type has EFA
    placement_group: bool = True
    capacity_reservation: CapacityReservationConfig | None = None
    # EKS replaces or reboots a node whose accelerators, kernel, network or storage the node monitoring
    # agent reports unhealthy, or that stays NotReady (cluster.node_monitoring_agent; docs/operations.md).
    node_auto_repair: bool = True

    @field_validator("instance_type")
    @classmethod
    def _accelerated_type(cls, v: str) -> str:
        if v not in CATALOG or not CATALOG[v].is_accelerated:
            raise FieldProblem("", v, ", ".join(accelerated_types()), "not an accelerated instance type in the catalog")
        return v

    @model_validator(mode="after")
    def _efa_only_where_supported(self):
        if self.efa and not self.instance.supports_efa:
            raise FieldProblem(
                "efa", True, "false for this type", f"{self.instance_type} has no EFA interfaces"
            )
        return self

    @model_validator(mode="after")
    def _capacity_that_can_be_had(self):
        if self.capacity_type is CapacityType.SPOT and (self.efa_enabled or self.placement_group):
            # One instance type, one AZ and a cluster placement group: a Spot request that
            # rarely finds capacity, and an EFA job that loses its nodes together.
            raise FieldProblem(
                "capacity_type", "SPOT", "ON_DEMAND for a group with EFA or a placement group (or set efa: false "
                "and placement_group: false)", "Spot capacity for one type in one placement group is rarely there")
        reservation = self.capacity_reservation
        if reservation is None:
            return self
        if self.capacity_type is CapacityType.SPOT:
            raise FieldProblem("capacity_type", "SPOT", "ON_DEMAND with a capacity_reservation",
                               "reserved capacity is not Spot")
        if reservation.kind == "capacity_block" and not self.instance.capacity_blocks:
            sold = ", ".join(n for n, t in sorted(CATALOG.items()) if t.capacity_blocks)
            raise FieldProblem("capacity_reservation.kind", "capacity_block", f"on_demand for {self.instance_type}; "
                               f"Capacity Blocks are sold for {sold}", f"{self.instance_type} has no Capacity Blocks")
        return self

    @property
    def instance(self) -> InstanceType:
        return lookup(self.instance_type)

    @property
    def efa_enabled(self) -> bool:
        return self.instance.supports_efa if self.efa is None else self.efa

    @property
    def efa_only_interfaces(self) -> bool:
        """Secondary network cards carry EFA-only interfaces (see the catalog)."""
        return self.efa_enabled and self.instance.efa_only_secondary
