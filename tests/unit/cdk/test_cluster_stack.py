"""The cluster stack: EKS, node groups in the compute subnet, add-ons, device plugins, autoscaling, charts."""

from __future__ import annotations

import json

import pytest

from config import CATALOG
from config.catalog import ACCELERATED_ROLE, NODE_ROLE_LABEL
from k8s_charts.node_check import NODE_CHECK_NAMESPACE, NODE_CHECK_SERVICE_ACCOUNT
from tests.conftest import EVERY_ACCELERATED_TYPE, VARIANTS, config_variant
from training.contract import NODE_CHECK_TAINT

HELM = "Custom::AWSCDK-EKS-HelmChart"
MANIFEST = "Custom::AWSCDK-EKS-KubernetesResource"


@pytest.fixture(scope="module")
def example(synth):
    return synth(VARIANTS["example"])


def template(result):
    return result.template(result.platform.cluster)


def resources(result, kind):
    return template(result).find_resources(kind)


def props(result, kind):
    return [r["Properties"] for r in resources(result, kind).values()]


def helm_charts(result) -> dict[str, dict]:
    return {p["Chart"]: p for p in props(result, HELM)}


def values(chart) -> dict:
    raw = chart["Values"]
    return json.loads(raw if isinstance(raw, str) else "".join(p if isinstance(p, str) else "TOKEN"
                                                                for p in raw["Fn::Join"][1]))


def test_the_control_plane_is_private_and_public_to_the_configured_cidrs_logged_and_encrypted(example):
    cluster = next(iter(resources(example, "AWS::EKS::Cluster").values()))["Properties"]
    assert cluster["Name"] == "mltrain" and cluster["Version"] == "1.34"
    access = cluster["ResourcesVpcConfig"]
    assert access["EndpointPrivateAccess"] is True and access["EndpointPublicAccess"] is True
    assert access["PublicAccessCidrs"] == ["203.0.113.0/24"]
    types = {t["Type"] for t in cluster["Logging"]["ClusterLogging"]["EnabledTypes"]}
    assert types == {"api", "audit", "authenticator", "controllerManager", "scheduler"}
    assert cluster["EncryptionConfig"][0]["Resources"] == ["secrets"]
    assert cluster["AccessConfig"]["AuthenticationMode"] in ("API", "API_AND_CONFIG_MAP")


def test_admins_get_cluster_admin_access_entries(synth):
    arn = "arn:aws:iam::123456789012:role/PlatformAdmin"
    result = synth(config_variant(**{"cluster.admin_principal_arns": [arn]}))
    entries = props(result, "AWS::EKS::AccessEntry")
    admin = next(e for e in entries if e["PrincipalArn"] == arn)
    assert "cluster-access-policy/AmazonEKSClusterAdminPolicy" in json.dumps(admin["AccessPolicies"][0]["PolicyArn"])


def test_the_kubectl_layer_matches_the_kubernetes_version(example):
    layers = props(example, "AWS::Lambda::LayerVersion")
    assert any("kubectl" in (layer.get("Description") or "").lower() and "1.34" in layer["Description"]
               for layer in layers), layers


def test_accelerated_groups_and_the_file_system_share_the_one_compute_subnet(example):
    groups = [p for p in props(example, "AWS::EKS::Nodegroup")
              if p["Labels"].get("training-platform/node-role") == "accelerated"]
    storage = example.template(example.platform.storage)
    fs = next(iter(storage.find_resources("AWS::FSx::FileSystem").values()))["Properties"]
    assert len(groups) == 2 and len(fs["SubnetIds"]) == 1
    # Both name the network stack's compute subnet through the same published output.
    for group in groups:
        assert group["Subnets"] == fs["SubnetIds"]
    assert "privateSubnet1Subnet" in json.dumps(fs["SubnetIds"])


def test_system_nodes_carry_the_system_label_and_no_taint(example):
    system = next(p for p in props(example, "AWS::EKS::Nodegroup")
                  if p["Labels"].get("training-platform/node-role") == "system")
    assert "Taints" not in system and system["AmiType"] == "AL2023_x86_64_STANDARD"
    assert (system["ScalingConfig"]["MinSize"], system["ScalingConfig"]["MaxSize"]) == (3, 4)  # one node per etcd member


def test_device_plugins_select_exactly_the_labels_and_tolerate_the_taints_the_node_groups_carry(example):
    groups = {p["Labels"]["training-platform/accelerator"]: p for p in props(example, "AWS::EKS::Nodegroup")
              if "training-platform/accelerator" in p["Labels"]}
    charts = helm_charts(example)
    nvidia, neuron, efa = (values(charts[c]) for c in ("nvidia-device-plugin", "neuron-helm-chart",
                                                        "aws-efa-k8s-device-plugin"))
    for label, value in nvidia["nodeSelector"].items():
        assert groups["nvidia"]["Labels"][label] == value
    assert {t["key"] for t in nvidia["tolerations"]} == {t["Key"] for t in groups["nvidia"]["Taints"]}
    for label, value in neuron["devicePlugin"]["nodeSelector"].items():
        assert groups["neuron"]["Labels"][label] == value
    assert {t["key"] for t in neuron["devicePlugin"]["tolerations"]} == {t["Key"] for t in groups["neuron"]["Taints"]}
    assert neuron["scheduler"] == {"enabled": False}  # see cluster_charts.py: it could not be scheduled on EKS
    assert all(g["Labels"]["vpc.amazonaws.com/efa.present"] == "true" for g in groups.values())
    assert efa["nodeSelector"] == {"vpc.amazonaws.com/efa.present": "true"}
    assert {t["key"] for t in efa["tolerations"]} == {"nvidia.com/gpu", "aws.amazon.com/neuron", NODE_CHECK_TAINT}


def test_every_helm_chart_is_pinned_to_the_configured_version(example):
    versions = example.config.versions
    expected = {
        "nvidia-device-plugin": versions.nvidia_device_plugin_chart,
        "neuron-helm-chart": versions.neuron_chart,
        "aws-efa-k8s-device-plugin": versions.efa_device_plugin_chart,
        "volcano": versions.volcano_chart,
        "cluster-autoscaler": example.config.cluster_autoscaler_chart,
        "cert-manager": versions.cert_manager_chart,
    }
    assert {name: chart["Version"] for name, chart in helm_charts(example).items()} == expected


def test_cert_manager_installs_its_crds_on_system_nodes_and_comes_before_the_certificates(example):
    chart = helm_charts(example)["cert-manager"]
    assert values(chart) == {"crds": {"enabled": True, "keep": True},
                      "global": {"nodeSelector": {"training-platform/node-role": "system"}}}
    assert chart["Wait"] is True  # its webhook admits Certificates only once it serves


def test_volcano_is_installed_without_the_enqueue_action(example):
    policy = values(helm_charts(example)["volcano"])["custom"]["scheduler_config_override"]
    assert policy.startswith("actions: allocate, backfill")


def test_add_ons_and_their_pod_identity_roles(example):
    addons = {p["AddonName"]: p for p in props(example, "AWS::EKS::Addon")}
    assert set(addons) == {"eks-pod-identity-agent", "vpc-cni", "kube-proxy", "coredns", "aws-fsx-csi-driver",
                           "aws-ebs-csi-driver", "amazon-cloudwatch-observability", "eks-node-monitoring-agent"}
    accounts = {name: a["PodIdentityAssociations"][0]["ServiceAccount"] for name, a in addons.items()
                if "PodIdentityAssociations" in a}
    assert accounts == {"vpc-cni": "aws-node", "aws-fsx-csi-driver": "fsx-csi-controller-sa",
                        "aws-ebs-csi-driver": "ebs-csi-controller-sa",
                        "amazon-cloudwatch-observability": "cloudwatch-agent"}
    # The FSx node plugin must run on the tainted GPU and Neuron nodes that mount the file system.
    assert json.loads(addons["aws-fsx-csi-driver"]["ConfigurationValues"])["node"]["tolerations"] == [
        {"operator": "Exists"}]
    cloudwatch = json.loads(addons["amazon-cloudwatch-observability"]["ConfigurationValues"])
    assert cloudwatch["agent"]["config"]["logs"]["metrics_collected"]["kubernetes"]["accelerated_compute_metrics"]
    # NetworkPolicies (etcd's, the jobs') are enforced only with the CNI's policy agent on; a string.
    assert json.loads(addons["vpc-cni"]["ConfigurationValues"]) == {"enableNetworkPolicy": "true"}


def test_add_on_versions_are_pinned_from_config(synth):
    result = synth(config_variant(**{"versions.addons": {"vpc-cni": "v1.20.4-eksbuild.1"}}))
    addons = {p["AddonName"]: p for p in props(result, "AWS::EKS::Addon")}
    assert addons["vpc-cni"]["AddonVersion"] == "v1.20.4-eksbuild.1"
    assert addons["coredns"]["AddonVersion"] == "v1.13.2-eksbuild.4"  # the 1.34 table
    assert "AddonVersion" not in addons["eks-pod-identity-agent"]  # EKS's default unless pinned


def test_node_health_the_monitoring_agent_reads_gpu_health_on_tainted_nodes_and_accelerated_groups_repair(example):
    addons = {p["AddonName"]: p for p in props(example, "AWS::EKS::Addon")}
    agent = addons["eks-node-monitoring-agent"]
    assert "PodIdentityAssociations" not in agent  # it calls the Kubernetes API and IMDS only
    # Its DCGM host engine tolerates no taint by default: the GPU nodes' would keep it, and XIDs, away.
    assert json.loads(agent["ConfigurationValues"]) == {"dcgmAgent": {"tolerations": [{"operator": "Exists"}]}}
    groups = props(example, "AWS::EKS::Nodegroup")
    accelerated = [g.get("NodeRepairConfig") for g in groups if g["Labels"][NODE_ROLE_LABEL] == ACCELERATED_ROLE]
    assert len(accelerated) == len(example.config.accelerated_node_groups)
    assert all(repair == {"Enabled": True} for repair in accelerated)


def test_node_repair_and_the_monitoring_agent_can_be_turned_off(synth):
    result = synth(config_variant(**{"cluster.node_monitoring_agent": False,
                                     "accelerated_node_groups.0.node_auto_repair": False}))
    assert "eks-node-monitoring-agent" not in {p["AddonName"] for p in props(result, "AWS::EKS::Addon")}
    # Said explicitly: a property left out would not turn off the repair a previous deploy enabled.
    assert {"Enabled": False} in [p.get("NodeRepairConfig") for p in props(result, "AWS::EKS::Nodegroup")]


def test_monitoring_can_be_turned_off(synth):
    result = synth(config_variant(**{"monitoring.enabled": False}))
    assert "amazon-cloudwatch-observability" not in {p["AddonName"] for p in props(result, "AWS::EKS::Addon")}


def test_the_autoscaler_scales_idle_nodes_to_zero_after_the_configured_time_and_only_this_cluster(example):
    autoscaler = values(helm_charts(example)["cluster-autoscaler"])
    assert autoscaler["extraArgs"]["scale-down-unneeded-time"] == "10m"
    assert autoscaler["autoDiscovery"]["clusterName"] == "mltrain"
    policies = json.dumps(props(example, "AWS::IAM::Policy"))
    assert '"aws:ResourceTag/k8s.io/cluster-autoscaler/mltrain": "owned"' in policies
    tagging = [json.dumps(p["Create"]) for p in props(example, "Custom::AWS") if "createOrUpdateTags" in json.dumps(p)]
    assert len(tagging) == 2 and all("node-template/resources/vpc.amazonaws.com/efa" in t for t in tagging)


def test_platform_charts_are_applied_after_what_they_need(example):
    manifests = resources(example, MANIFEST)
    by_kind = {}
    for logical_id, resource in manifests.items():
        text = json.dumps(resource["Properties"]["Manifest"])
        for kind in ("PersistentVolume", "Queue", "Deployment", "Namespace"):
            if f'\\"kind\\":\\"{kind}\\"' in text:
                by_kind.setdefault(kind, (logical_id, resource))
    addons = {p_id for p_id, r in resources(example, "AWS::EKS::Addon").items()
              if r["Properties"]["AddonName"] == "aws-fsx-csi-driver"}
    admission = set(resources(example, "Custom::AWSCDK-EKS-KubernetesObjectValue"))
    assert addons & set(by_kind["PersistentVolume"][1]["DependsOn"])
    assert admission & set(by_kind["Queue"][1]["DependsOn"])


def test_training_pods_get_the_trainer_role_and_only_the_buckets_prefixes(example):
    association = next(p for p in props(example, "AWS::EKS::PodIdentityAssociation")
                       if p["ServiceAccount"] == "trainer")
    assert association["Namespace"] == "training"
    storage = example.template(example.platform.storage)
    statements = [s for p in storage.find_resources("AWS::IAM::Policy").values()
                  if "TrainerRole" in json.dumps(p["Properties"]["Roles"])
                  for s in p["Properties"]["PolicyDocument"]["Statement"]]
    object_resources = json.dumps([s["Resource"] for s in statements])
    assert "/datasets/*" in object_resources and "/checkpoints/*" in object_resources


def launch_template_data(result, instance_type: str) -> dict:
    """The one launch template for ``instance_type`` in the cluster's template."""
    (launch,) = [p["LaunchTemplateData"] for p in props(result, "AWS::EC2::LaunchTemplate")
                 if p["LaunchTemplateData"].get("InstanceType") == instance_type]
    return launch


@pytest.mark.parametrize("instance_type", [t for t, f in CATALOG.items() if f.is_accelerated])
def test_every_accelerated_type_synthesizes_as_a_node_group(synth, instance_type):
    launch = launch_template_data(synth(EVERY_ACCELERATED_TYPE), instance_type)
    assert len(launch.get("NetworkInterfaces", [])) == CATALOG[instance_type].efa_interfaces


# --- node group versions and update order -------------------------------------------------------

def node_groups(result) -> dict[str, dict]:
    return resources(result, "AWS::EKS::Nodegroup")


def control_plane(result) -> tuple[str, dict]:
    (logical_id, cluster), = resources(result, "AWS::EKS::Cluster").items()
    return logical_id, cluster


def referenced(value) -> set[str]:
    """The logical ids a property value names with Ref or Fn::GetAtt."""
    if isinstance(value, dict):
        found = set()
        for key, inner in value.items():
            if key == "Ref" and isinstance(inner, str):
                found.add(inner)
            elif key == "Fn::GetAtt":
                found.add(inner[0] if isinstance(inner, list) else inner.split(".")[0])
            else:
                found |= referenced(inner)
        return found
    if isinstance(value, list):
        return set().union(*map(referenced, value)) if value else set()
    return set()


def updated_after(template_resources: dict[str, dict], logical_id: str) -> set[str]:
    """Everything CloudFormation updates before ``logical_id``: its Ref/GetAtt targets and DependsOn,
    transitively ("Resource B is updated before resource A", the DependsOn attribute's documentation)."""
    seen: set[str] = set()
    todo = [logical_id]
    while todo:
        resource = template_resources.get(todo.pop(), {})
        depends = resource.get("DependsOn", [])
        direct = (referenced(resource.get("Properties", {})) | set([depends] if isinstance(depends, str) else depends))
        for other in direct & template_resources.keys() - seen:
            seen.add(other)
            todo.append(other)
    return seen


def test_every_node_group_runs_the_control_planes_minor(example):
    _, cluster = control_plane(example)
    groups = node_groups(example)
    assert len(groups) == 3  # system, p4d, trn1
    assert {name: g["Properties"].get("Version") for name, g in groups.items()} == \
        {name: cluster["Properties"]["Version"] for name in groups}
    assert not any("ReleaseVersion" in g["Properties"] for g in groups.values())  # EKS's newest for the minor


@pytest.mark.parametrize("changes, control, nodes, release", [
    ({"cluster.kubernetes_version": "1.35"}, "1.35", "1.35", None),
    ({"cluster.kubernetes_version": "1.35", "cluster.ami_release_version": "1.34.4-20260101"},
     "1.35", "1.34", "1.34.4-20260101"),
], ids=["bumped", "held-back"])
def test_node_groups_follow_the_one_version_field(synth, changes, control, nodes, release):
    result = synth(config_variant(**changes))
    assert control_plane(result)[1]["Properties"]["Version"] == control
    for group in node_groups(result).values():
        assert (group["Properties"]["Version"], group["Properties"].get("ReleaseVersion")) == (nodes, release)


def test_node_groups_are_updated_after_the_control_plane_and_the_vpc_cni(example):
    everything = template(example).to_json()["Resources"]
    cluster_id, _ = control_plane(example)
    (cni_id,) = [k for k, r in resources(example, "AWS::EKS::Addon").items() if r["Properties"]["AddonName"] == "vpc-cni"]
    for logical_id in node_groups(example):
        before = updated_after(everything, logical_id)
        assert {cluster_id, cni_id} <= before, logical_id
        assert logical_id not in updated_after(everything, cluster_id)  # and never the other way round


def test_the_order_check_sees_a_missing_dependency():
    resources_ = {"Cluster": {"Type": "AWS::EKS::Cluster"},
                  "Group": {"Type": "AWS::EKS::Nodegroup", "Properties": {"ClusterName": "mltrain"}}}
    assert updated_after(resources_, "Group") == set()
    resources_["Group"]["Properties"]["ClusterName"] = {"Ref": "Cluster"}
    assert updated_after(resources_, "Group") == {"Cluster"}


def test_accelerated_nodes_join_tainted_and_the_node_check_is_applied(example):
    groups = [g for g in props(example, "AWS::EKS::Nodegroup") if g["Labels"][NODE_ROLE_LABEL] == ACCELERATED_ROLE]
    assert groups and all({"Effect": "NO_SCHEDULE", "Key": NODE_CHECK_TAINT, "Value": "pending"} in g["Taints"]
                          for g in groups)
    manifests = json.dumps(props(example, MANIFEST))
    assert manifests.count('\\"kind\\":\\"DaemonSet\\"') == 2  # one per accelerator of the example: nvidia, neuron
    assert '\\"kind\\":\\"ValidatingAdmissionPolicy\\"' in manifests
    # Kept failed nodes need no AWS right: no role for the check.
    assert not [p for p in props(example, "AWS::EKS::PodIdentityAssociation") if p["Namespace"] == NODE_CHECK_NAMESPACE]


def test_terminating_failed_nodes_gives_the_check_one_action_on_this_clusters_groups(synth):
    result = synth(config_variant(**{"cluster.node_check.failed_nodes": "terminate"}))
    (association,) = [p for p in props(result, "AWS::EKS::PodIdentityAssociation")
                      if p["Namespace"] == NODE_CHECK_NAMESPACE]
    assert association["ServiceAccount"] == NODE_CHECK_SERVICE_ACCOUNT
    statements = [s for p in props(result, "AWS::IAM::Policy") for s in p["PolicyDocument"]["Statement"]
                  if s["Action"] == "autoscaling:TerminateInstanceInAutoScalingGroup"]
    assert statements == [{"Action": "autoscaling:TerminateInstanceInAutoScalingGroup", "Effect": "Allow",
                           "Resource": "*", "Condition": {"StringEquals": {
                               "aws:ResourceTag/k8s.io/cluster-autoscaler/mltrain": "owned"}}}]


def test_without_the_node_check_nodes_join_untainted_by_it_and_no_check_is_applied(synth):
    result = synth(config_variant(**{"cluster.node_check": {"enabled": False}}))
    assert NODE_CHECK_TAINT not in json.dumps(props(result, "AWS::EKS::Nodegroup"))
    manifests = json.dumps(props(result, MANIFEST))
    assert "training-platform-node-check" not in manifests and '\\"kind\\":\\"DaemonSet\\"' not in manifests
