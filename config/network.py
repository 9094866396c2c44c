"""The platform config's network section: the VPC."""

from __future__ import annotations

import ipaddress

from pydantic import Field, field_validator

from typed_config import FieldProblem, StrictModel
from config.fields import (
    RetentionDays,
)


class NetworkConfig(StrictModel):
    """The VPC. The compute AZ gets exactly one private compute subnet."""

    vpc_cidr: str = "10.0.0.0/16"
    nat_gateways: int = Field(default=1, le=2)
    interface_endpoints: bool = True
    flow_logs_retention_days: RetentionDays = 90

    @field_validator("vpc_cidr")
    @classmethod
    def _cidr(cls, v: str) -> str:
        try:
            net = ipaddress.IPv4Network(v, strict=True)
        except ValueError:
            raise FieldProblem("", v, "an IPv4 network in CIDR form, e.g. 10.0.0.0/16", "not an IPv4 CIDR") from None
        if not 16 <= net.prefixlen <= 20:
            raise FieldProblem("", v, "a prefix length from /16 to /20", "prefix length out of range")
        return v

    @field_validator("nat_gateways")
    @classmethod
    def _a_way_out(cls, v: int) -> int:
        # A cluster without NAT would need the eks-auth, eks, autoscaling and sqs endpoints, a
        # registry mirror for every chart and image the platform installs (NVIDIA, Volcano,
        # etcd, the autoscaler come from public registries) and the autoscaler's static
        # instance list. Half of that is a cluster whose nodes never become Ready, so the
        # mode is refused rather than half-supported (docs/operations.md, "Private clusters").
        if v < 1:
            raise FieldProblem("", v, "1 or 2", "a cluster without NAT gateways (private mode) is not supported: "
                               "its nodes could not pull the platform's charts and images")
        return v
