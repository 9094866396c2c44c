"""The first deploy works where our code meets real components: charts, controllers, EKS, EC2.

Each test holds the synthesized platform to what the pinned upstream component does (its
source read at the tag, tests/upstream_charts.py) or to the real API (moto), not to what our
code believes.
"""

from __future__ import annotations

import json
import threading
import types
from http.server import BaseHTTPRequestHandler, HTTPServer

import boto3
import pytest
from moto import mock_aws

from cdk_constructs.autoscaled_size_handler import current_desired_size, handler
from cdk_constructs.cluster_charts import ClusterCharts, nulls
from config import CATALOG, ConfigError, parse_config
from config.catalog import INSTANCE_TYPE_LABEL
from config.cluster import SUPPORTED_KUBERNETES_VERSIONS
from config.versions import ADDON_VERSIONS, CLUSTER_AUTOSCALER_CHARTS, MIN_VPC_CNI_FOR_EFA_ONLY, autoscaler_minor, semver
from tests.conftest import EVERY_ACCELERATED_TYPE, VARIANTS, config_variant
from tests.unit.cdk.test_cluster_stack import HELM, helm_charts, launch_template_data, props, resources, values
from tests.upstream_charts import NVIDIA_0_17_1_DEFAULT_AFFINITY, PLACEMENT, schedulable_on

DEVICE_PLUGINS = {"nvidia-device-plugin": "nvidia", "neuron-helm-chart": "neuron", "aws-efa-k8s-device-plugin": "efa"}
OBJECT_VALUE = "Custom::AWSCDK-EKS-KubernetesObjectValue"
MANIFEST = "Custom::AWSCDK-EKS-KubernetesResource"


@pytest.fixture(scope="module")
def every_family(synth):
    return synth(VARIANTS["every-family"])


@pytest.fixture(scope="module")
def example(synth):
    return synth(VARIANTS["example"])


def problems(data) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "cfg.yaml")
    return caught.value.problems


def node_groups(result) -> dict[str, dict]:
    """Accelerated node groups by name, with the labels their nodes carry (ours plus the kubelet's)."""
    groups = {}
    for group in props(result, "AWS::EKS::Nodegroup"):
        name = group["Labels"].get("training-platform/node-group")
        if name:
            config = next(g for g in result.config.accelerated_node_groups if g.name == name)
            groups[name] = {**group, "NodeLabels": {**group["Labels"], INSTANCE_TYPE_LABEL: config.instance_type},
                            "config": config}
    return groups


# --- 1. device plugins run where the devices are ------------------------------------------------

def test_no_helm_release_is_given_a_null_anywhere(synth):
    for name, variant in VARIANTS.items():
        result = synth(variant)
        releases = result.platform.cluster.charts.releases
        assert set(releases) == set(helm_charts(result)), name  # the guard saw every release
        for chart, chart_values in releases.items():
            assert nulls(chart_values) == [], (name, chart)


def test_a_null_in_helm_values_stops_synth_with_the_path():
    assert nulls({"affinity": None, "a": [{"b": None}]}) == ["affinity", "a[0].b"]
    charts = types.SimpleNamespace(releases={}, _cluster=None)
    with pytest.raises(ValueError, match="nvidia-device-plugin hold null at affinity"):
        ClusterCharts._chart(charts, "X", "nvidia-device-plugin", "repo", "0.17.1", "kube-system", {"affinity": None})


# A cluster whose groups lack a family or EFA: the named variants all mix families, and
# EVERY_ACCELERATED_TYPE holds every family, so these two keep the "left out" branches synthesized.
@pytest.mark.parametrize("instance_type", ["trn1.32xlarge", "g5.xlarge"])
def test_a_cluster_gets_the_device_plugins_of_its_groups_and_no_other(synth, instance_type):
    group = {"name": "g", "instance_type": instance_type, "min_size": 0, "desired_size": 0, "max_size": 2}
    result = synth(config_variant(accelerated_node_groups=[group]))
    (config,) = result.config.accelerated_node_groups
    expected = {chart: config.efa_enabled if device == "efa" else config.instance.accelerator.value == device
                for chart, device in DEVICE_PLUGINS.items()}
    assert {chart: chart in helm_charts(result) for chart in DEVICE_PLUGINS} == expected
    assert not all(expected.values())  # Neuron with EFA and no NVIDIA; NVIDIA without EFA or Neuron


@pytest.mark.parametrize("variant", ["example", "every-family"])
def test_each_device_plugin_runs_exactly_on_the_nodes_that_have_its_device(synth, variant):
    result = synth(VARIANTS[variant])
    charts = helm_charts(result)
    groups = node_groups(result)
    assert groups
    for chart, device in DEVICE_PLUGINS.items():
        if chart not in charts:
            continue
        selector, affinity = PLACEMENT[(chart, charts[chart]["Version"])](values(charts[chart]))
        for name, group in groups.items():
            instance = group["config"].instance
            has_device = {"nvidia": instance.accelerator.value == "nvidia",
                          "neuron": instance.accelerator.value == "neuron", "efa": group["config"].efa_enabled}[device]
            assert schedulable_on(selector, affinity, group["NodeLabels"]) == has_device, (chart, name)


def test_the_nvidia_charts_default_affinity_would_keep_the_plugin_off_every_eks_node(every_family):
    # What the old values ({"affinity": None}, dropped by CDK) produced: the chart's NFD terms.
    p5 = node_groups(every_family)["p5"]["NodeLabels"]
    assert not schedulable_on({}, NVIDIA_0_17_1_DEFAULT_AFFINITY, p5)


def test_nvidia_nodes_carry_the_gpu_label_cluster_autoscaler_reads(every_family):
    groups = node_groups(every_family)
    assert groups["p5"]["Labels"]["k8s.amazonaws.com/accelerator"] == "nvidia-h100"
    assert "k8s.amazonaws.com/accelerator" not in groups["trn1n"]["Labels"]
    tags = [json.dumps(p["Create"]) for p in props(every_family, "Custom::AWS") if "createOrUpdateTags" in json.dumps(p)]
    assert any("node-template/label/k8s.amazonaws.com/accelerator" in t and "nvidia-h100" in t for t in tags)


# --- 2. Volcano before anything that its webhooks admit --------------------------------------------

def test_volcano_waits_on_system_nodes_and_pulls_only_missing_images(example):
    volcano = next((i, r) for i, r in resources(example, HELM).items() if r["Properties"]["Chart"] == "volcano")
    logical_id, resource = volcano
    assert resource["Properties"]["Wait"] is True
    chart_values = values(resource["Properties"])
    assert chart_values["basic"]["image_pull_policy"] == "IfNotPresent"
    assert chart_values["custom"]["default_ns"] == {"training-platform/node-role": "system"}
    system = next(i for i, r in resources(example, "AWS::EKS::Nodegroup").items()
                  if r["Properties"]["Labels"].get("training-platform/node-role") == "system")
    assert system in resource["DependsOn"]


def test_the_queue_is_applied_only_once_volcanos_webhooks_have_admitted_a_queue(example):
    volcano = next(i for i, r in resources(example, HELM).items() if r["Properties"]["Chart"] == "volcano")
    gate_id, gate = next(iter(resources(example, OBJECT_VALUE).items()))
    assert gate["Properties"]["ObjectType"] == "queues.scheduling.volcano.sh"
    assert gate["Properties"]["ObjectName"] == "default" and gate["Properties"]["JsonPath"] == ".metadata.uid"
    assert volcano in gate["DependsOn"]
    queue = next(r for r in resources(example, MANIFEST).values()
                 if '\\"kind\\":\\"Queue\\"' in json.dumps(r["Properties"]["Manifest"]))
    assert gate_id in queue["DependsOn"]


# --- 3. the autoscaler matches the cluster and keeps its node counts -----------------------------

@pytest.mark.parametrize("minor", SUPPORTED_KUBERNETES_VERSIONS)
def test_the_autoscaler_chart_runs_the_clusters_minor(synth, minor):
    result = synth(config_variant(**{"cluster.kubernetes_version": minor}))
    chart = helm_charts(result)["cluster-autoscaler"]["Version"]
    assert chart == CLUSTER_AUTOSCALER_CHARTS[minor] and autoscaler_minor(chart) == minor


def test_an_autoscaler_chart_of_another_minor_is_one_line():
    assert problems(config_variant(**{"versions.cluster_autoscaler_chart": "9.50.0"})) == [
        'versions.cluster_autoscaler_chart: got "9.50.0" (it runs cluster-autoscaler 1.33); allowed: a chart '
        "from 9.52.0 to 9.53.0 for Kubernetes 1.34, or leave it out"]


def test_node_groups_take_their_desired_size_from_the_live_group_not_the_template(example):
    sizes = resources(example, "Custom::NodegroupDesiredSize")
    for group in props(example, "AWS::EKS::Nodegroup"):
        desired = group["ScalingConfig"]["DesiredSize"]
        assert set(desired) == {"Fn::GetAtt"} and desired["Fn::GetAtt"][0] in sizes
        size = sizes[desired["Fn::GetAtt"][0]]["Properties"]
        assert (size["MinSize"], size["MaxSize"]) == (group["ScalingConfig"]["MinSize"], group["ScalingConfig"]["MaxSize"])


@pytest.fixture
def eks():
    with mock_aws():
        client = boto3.client("eks", region_name="us-west-2", aws_access_key_id="t", aws_secret_access_key="t")
        client.create_cluster(name="mltrain", roleArn="arn:aws:iam::123456789012:role/eks",
                              resourcesVpcConfig={"subnetIds": []})
        yield client


def test_the_desired_size_is_the_initial_one_until_the_group_exists_then_what_the_autoscaler_chose(eks):
    label = ("training-platform/node-group", "p4d")
    assert current_desired_size(eks, "mltrain", *label, 0, 4, 0) == 0
    eks.create_nodegroup(clusterName="mltrain", nodegroupName="p4d-abc", nodeRole="arn:aws:iam::123456789012:role/node",
                         subnets=["subnet-1"], labels={label[0]: label[1]},
                         scalingConfig={"minSize": 0, "maxSize": 4, "desiredSize": 0})
    eks.create_nodegroup(clusterName="mltrain", nodegroupName="system-xyz", nodeRole="arn:aws:iam::123456789012:role/node",
                         subnets=["subnet-1"], labels={"training-platform/node-role": "system"},
                         scalingConfig={"minSize": 2, "maxSize": 4, "desiredSize": 2})
    eks.update_nodegroup_config(clusterName="mltrain", nodegroupName="p4d-abc", scalingConfig={"desiredSize": 3})
    assert current_desired_size(eks, "mltrain", *label, 0, 4, 0) == 3  # the autoscaler's choice survives
    assert current_desired_size(eks, "mltrain", *label, 0, 2, 0) == 2  # clamped to a lowered max
    assert current_desired_size(eks, "mltrain", *label, 4, 8, 0) == 4  # and to a raised min
    assert current_desired_size(eks, "mltrain", "training-platform/node-role", "system", 2, 4, 2) == 2


def test_the_handler_answers_cloudformation_on_success_and_on_failure(eks):
    answers = []

    class Receiver(BaseHTTPRequestHandler):
        def do_PUT(self):
            answers.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    event = {"RequestType": "Create", "ResponseURL": f"http://127.0.0.1:{server.server_port}/r", "StackId": "s",
             "RequestId": "q", "LogicalResourceId": "Size", "ResourceProperties": {
                 "ClusterName": "mltrain", "LabelKey": "training-platform/node-group", "LabelValue": "p4d",
                 "MinSize": "0", "MaxSize": "4", "InitialSize": "1"}}
    try:
        handler(event, None, eks=eks)
        handler({**event, "ResourceProperties": {**event["ResourceProperties"], "ClusterName": "missing"}}, None,
                eks=eks)
    finally:
        server.shutdown()
    assert answers[0]["Status"] == "SUCCESS" and answers[0]["Data"] == {"DesiredSize": 1}
    assert answers[1]["Status"] == "FAILED" and "missing" in answers[1]["Reason"]


# --- 4. no half-supported private mode ------------------------------------------------------------

def test_a_cluster_without_nat_is_refused_with_the_reason():
    assert problems(config_variant(**{"network.nat_gateways": 0})) == [
        "network.nat_gateways: got 0 (a cluster without NAT gateways (private mode) is not supported: its nodes "
        "could not pull the platform's charts and images); allowed: 1 or 2"]


# --- 5. etcd's volume can bind ----------------------------------------------------------------------

def test_the_ebs_csi_driver_and_an_encrypted_gp3_class_exist_before_etcd(example):
    addons = {r["Properties"]["AddonName"]: i for i, r in resources(example, "AWS::EKS::Addon").items()}
    assert "aws-ebs-csi-driver" in addons
    association = next(a for a in props(example, "AWS::EKS::Addon") if a["AddonName"] == "aws-ebs-csi-driver")
    assert association["PodIdentityAssociations"][0]["ServiceAccount"] == "ebs-csi-controller-sa"
    manifests = resources(example, MANIFEST)
    class_id, storage_class = next((i, r) for i, r in manifests.items()
                                   if '\\"kind\\":\\"StorageClass\\"' in json.dumps(r["Properties"]["Manifest"]))
    manifest = json.loads(storage_class["Properties"]["Manifest"])[0]
    assert manifest["metadata"]["name"] == example.config.jobs.etcd.storage_class
    assert manifest["provisioner"] == "ebs.csi.aws.com"
    assert manifest["parameters"] == {"type": "gp3", "encrypted": "true"}
    assert addons["aws-ebs-csi-driver"] in storage_class["DependsOn"]
    etcd = next(r for r in manifests.values() if '\\"name\\":\\"etcd\\"' in json.dumps(r["Properties"]["Manifest"])
                and '\\"kind\\":\\"Service\\"' in json.dumps(r["Properties"]["Manifest"]))
    assert class_id in etcd["DependsOn"]


# --- 6. EFA interfaces as EC2 documents them ----------------------------------------------------------

@pytest.mark.parametrize("instance_type", [t for t, f in CATALOG.items() if f.supports_efa])
def test_secondary_cards_take_efa_only_interfaces_where_the_type_supports_them(synth, instance_type):
    interfaces = launch_template_data(synth(EVERY_ACCELERATED_TYPE), instance_type)["NetworkInterfaces"]
    assert (interfaces[0]["InterfaceType"], interfaces[0]["DeviceIndex"]) == ("efa", 0)
    expected = ("efa-only", 0) if CATALOG[instance_type].efa_only_secondary else ("efa", 1)
    assert all((i["InterfaceType"], i["DeviceIndex"]) == expected for i in interfaces[1:])
    assert [i["NetworkCardIndex"] for i in interfaces] == list(range(CATALOG[instance_type].efa_interfaces))


def test_p5_and_trn2_save_a_subnet_address_per_secondary_card():
    assert {t for t, f in CATALOG.items() if f.efa_only_secondary} >= {
        "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge", "trn2.48xlarge"}


def test_the_vpc_cni_is_pinned_new_enough_for_efa_only_and_node_groups_wait_for_it(every_family):
    addons = {r["Properties"]["AddonName"]: (i, r["Properties"]) for i, r in resources(every_family,
                                                                                      "AWS::EKS::Addon").items()}
    cni_id, cni = addons["vpc-cni"]
    assert semver(cni["AddonVersion"]) >= MIN_VPC_CNI_FOR_EFA_ONLY
    for logical_id, group in resources(every_family, "AWS::EKS::Nodegroup").items():
        assert cni_id in group["DependsOn"], logical_id


def test_an_old_vpc_cni_with_efa_only_groups_is_one_line():
    data = config_variant(**{"versions.addons": {"vpc-cni": "v1.18.4-eksbuild.1"}},
                          accelerated_node_groups=[{"name": "p5", "instance_type": "p5.48xlarge", "min_size": 0,
                                                    "desired_size": 0, "max_size": 2}])
    assert problems(data) == ['versions.addons.vpc-cni: got "v1.18.4-eksbuild.1" (EFA-only interfaces need a newer '
                              "VPC CNI); allowed: v1.19.0 or later"]


def test_the_efa_plugin_chart_is_pinned_as_the_chart_that_ships_the_intended_image(example):
    assert helm_charts(example)["aws-efa-k8s-device-plugin"]["Version"] == "v0.5.30"


# --- 7. add-ons pinned per Kubernetes minor -------------------------------------------------------------

@pytest.mark.parametrize("minor", SUPPORTED_KUBERNETES_VERSIONS)
def test_networking_add_ons_are_pinned_for_every_minor(synth, minor):
    result = synth(config_variant(**{"cluster.kubernetes_version": minor}))
    versions = {p["AddonName"]: p.get("AddonVersion") for p in props(result, "AWS::EKS::Addon")}
    for addon, version in ADDON_VERSIONS[minor].items():
        assert versions[addon] == version
    assert versions["kube-proxy"].startswith(f"v{minor}.")


def test_a_pinned_add_on_version_wins(synth):
    result = synth(config_variant(**{"versions.addons": {"aws-fsx-csi-driver": "v1.5.0-eksbuild.1"}}))
    versions = {p["AddonName"]: p.get("AddonVersion") for p in props(result, "AWS::EKS::Addon")}
    assert versions["aws-fsx-csi-driver"] == "v1.5.0-eksbuild.1"


# --- 8. capacity that can be had --------------------------------------------------------------------------

def test_spot_for_an_efa_or_placement_group_is_one_line():
    spot = config_variant(**{"accelerated_node_groups.0.capacity_type": "SPOT"})
    assert problems(spot) == [
        'accelerated_node_groups[0].capacity_type: got "SPOT" (Spot capacity for one type in one placement group '
        "is rarely there); allowed: ON_DEMAND for a group with EFA or a placement group (or set efa: false and "
        "placement_group: false)"]


def test_a_capacity_block_targets_its_reservation(every_family):
    group = node_groups(every_family)["p5en"]
    assert group["CapacityType"] == "CAPACITY_BLOCK"
    launch = next(p for p in props(every_family, "AWS::EC2::LaunchTemplate")
                  if p["LaunchTemplateData"].get("InstanceType") == "p5en.48xlarge")["LaunchTemplateData"]
    assert launch["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    assert launch["CapacityReservationSpecification"] == {
        "CapacityReservationTarget": {"CapacityReservationId": "cr-0123456789abcdef0"}}


@pytest.mark.parametrize(("change", "expected"), [
    ({"accelerated_node_groups.0.capacity_reservation": {"kind": "capacity_block", "id": "cr-1"}},
     'accelerated_node_groups[0].capacity_reservation.id: got "cr-1"; allowed: a capacity reservation id, '
     "e.g. cr-0123456789abcdef0"),
    ({"accelerated_node_groups.0.instance_type": "g5.48xlarge",
      "accelerated_node_groups.0.capacity_reservation": {"kind": "capacity_block", "id": "cr-0123456789abcdef0"}},
     'accelerated_node_groups[0].capacity_reservation.kind: got "capacity_block" (g5.48xlarge has no Capacity '
     "Blocks); allowed: on_demand for g5.48xlarge; Capacity Blocks are sold for p4d.24xlarge, p5.48xlarge, "
     "p5e.48xlarge, p5en.48xlarge, trn1.32xlarge, trn2.48xlarge"),
])
def test_capacity_reservation_mistakes_are_one_line(change, expected):
    assert problems(config_variant(**change)) == [expected]


def test_no_termination_handler_or_account_wide_event_rules(example):
    charts = helm_charts(example)
    assert "aws-node-termination-handler" not in charts
    assert not resources(example, "AWS::Events::Rule") and not resources(example, "AWS::SQS::Queue")
