"""The EFA launch template, for every accelerated type in the catalog."""

from __future__ import annotations

import pytest
from aws_cdk import App, Stack
from aws_cdk.assertions import Template

from cdk_constructs.efa_launch_template import EfaLaunchTemplate, EfaLaunchTemplateProps
from config import CATALOG
from config.catalog import accelerated_types

GROUPS = ["sg-node", "sg-cluster"]


def template_for(instance_type: str, efa: bool = True, placement: str | None = "pg-1") -> dict:
    stack = Stack(App(), "Test")
    EfaLaunchTemplate(stack, "Lt", EfaLaunchTemplateProps(CATALOG[instance_type], efa, GROUPS, placement))
    resources = Template.from_stack(stack).find_resources("AWS::EC2::LaunchTemplate")
    assert len(resources) == 1
    return next(iter(resources.values()))["Properties"]["LaunchTemplateData"]


@pytest.mark.parametrize("instance_type", accelerated_types())
def test_one_efa_interface_per_network_card_from_the_catalog(instance_type):
    data = template_for(instance_type, efa=CATALOG[instance_type].supports_efa)
    expected = CATALOG[instance_type].efa_interfaces
    interfaces = data.get("NetworkInterfaces", [])
    assert len(interfaces) == expected
    for card, interface in enumerate(interfaces):
        assert interface == {"NetworkCardIndex": card, "DeviceIndex": 0 if card == 0 else 1, "InterfaceType": "efa",
                             "DeleteOnTermination": True, "Groups": GROUPS}
    # Groups on the interfaces replace SecurityGroupIds; without interfaces they go on the template.
    assert ("SecurityGroupIds" in data) == (expected == 0)


@pytest.mark.parametrize("instance_type", ["p3.8xlarge", "trn1.2xlarge"])
def test_types_without_efa_get_no_interfaces(instance_type):
    data = template_for(instance_type, efa=False)
    assert "NetworkInterfaces" not in data and data["SecurityGroupIds"] == GROUPS


def test_efa_turned_off_in_config_gives_no_interfaces():
    assert "NetworkInterfaces" not in template_for("p4d.24xlarge", efa=False)


def test_imdsv2_encrypted_gp3_root_and_the_placement_group():
    data = template_for("p5.48xlarge")
    assert data["MetadataOptions"]["HttpTokens"] == "required"
    assert data["BlockDeviceMappings"][0]["Ebs"] == {
        "VolumeSize": 200, "VolumeType": "gp3", "Encrypted": True, "DeleteOnTermination": True}
    assert data["BlockDeviceMappings"][0]["Ebs"]["Encrypted"] is True
    assert data["Placement"] == {"GroupName": "pg-1"}
    assert len(data["NetworkInterfaces"]) == 32
    assert "ImageId" not in data and "UserData" not in data  # EKS chooses the AMI of the AMI type


def test_no_placement_group_when_turned_off():
    assert "Placement" not in template_for("p4d.24xlarge", placement=None)
