"""Placement by network topology: the job spec's field, the Job's spec.networkTopology, and the Volcano
settings that make it work (the scheduler's plugin, the controller's HyperNode discovery from EKS's labels).

Read at volcano-sh/volcano tag v1.15.1: the Job CRD's networkTopology
(staging/src/volcano.sh/apis/pkg/apis/batch/v1alpha1/job.go), the chart's ConfigMap template
(installer/helm/chart/volcano/templates/controllers.yaml) and the label discovery
(pkg/controllers/hypernode/discovery/label/label.go, utils/utils.go). The HyperNode CRD is vendored in
tests/crds/volcano-v1.15.1 (its README says from where).
"""

from __future__ import annotations

from dataclasses import replace

import jsonschema
import pytest
import yaml

from config import parse_config
from config.catalog import CATALOG, NETWORK_LAYERS
from config.job_spec import parse_job_spec
from k8s_charts.volcano import helm_values
from tests.conftest import REPO, example_data
from tests.unit.test_charts import CONFIG, CRDS, RENDERED, VOLCANO_OBJECTS, _crd_validator, render, the_job
from typed_config import ConfigError

VENDORED_CRDS = REPO / "tests" / "crds" / "volcano-v1.15.1"
HYPERNODE_CRD = "topology.volcano.sh_hypernodes.yaml"
LAYER = "topology.k8s.aws/network-node-layer-"
SOURCE = "volcano.sh/network-topology-source"
JOB = {"name": "j", "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainer:gpu-0.1.0", "node_group": "p4d",
       "max_nodes": 2}


def config_with(instance_type: str):
    data = example_data()
    data["accelerated_node_groups"] = [{"name": "g", "instance_type": instance_type, "min_size": 0,
                                        "desired_size": 0, "max_size": 4}]
    return parse_config(data)


def rendered_job(config, changes: dict) -> dict:
    spec = parse_job_spec({**JOB, **changes}, config)
    return the_job(render(config, [spec], None), spec.name)


def problems(changes: dict, config=CONFIG) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_job_spec({**JOB, **changes}, config)
    return caught.value.problems


# --- the job spec and the Job ------------------------------------------------------------------


def test_a_hard_job_and_its_nccl_check_carry_the_tier_and_are_among_the_jobs_checked_against_the_crd():
    for name in ("network-hard", "network-hard-nccl-check"):
        job = the_job(RENDERED, name)
        # highestTierAllowed always: in v1.15.1 hard without it is no constraint (job_info.go IsHardTopologyMode);
        # never highestTierName beside it (admit_job.go validateNetworkTopology).
        assert job["spec"]["networkTopology"] == {"mode": "hard", "highestTierAllowed": 2}
        assert any(o is job for o in VOLCANO_OBJECTS)  # test_charts validates every one against the Job CRD


@pytest.mark.skipif(not CRDS.is_dir(), reason=f"Volcano CRD schemas not found at {CRDS}")
@pytest.mark.parametrize(("topology", "expected"), [
    ({"mode": "hard"}, {"mode": "hard", "highestTierAllowed": 1}),
    ({"mode": "soft", "tier": 3}, {"mode": "soft", "highestTierAllowed": 3}),
    ({"mode": "none"}, None),
    ({}, None),
])
def test_the_job_spec_mode_and_tier_become_the_jobs_network_topology(topology, expected):
    job = rendered_job(CONFIG, {"network_topology": topology})
    assert job["spec"].get("networkTopology") == expected
    _crd_validator("batch.volcano.sh_jobs.yaml").validate(job)


def test_jobs_without_a_topology_render_none():
    assert "networkTopology" not in the_job(RENDERED, "resnet50-imagenet")["spec"]
    assert "networkTopology" not in rendered_job(config_with("g5.12xlarge"), {"node_group": "g"})["spec"]


@pytest.mark.parametrize(("instance_type", "mode"), [("g5.12xlarge", "hard"), ("p3.8xlarge", "soft")])
def test_a_topology_on_a_type_without_one_is_one_line(instance_type, mode):
    assert problems({"node_group": "g", "network_topology": {"mode": mode}}, config_with(instance_type)) == [
        f'network_topology.mode: got "{mode}" ({instance_type} has no network topology in EC2\'s '
        "DescribeInstanceTopology); allowed: none"]


def test_a_tier_above_the_types_layers_is_one_line(monkeypatch):
    # No type of the catalog has 1 or 2 layers (test_catalog.py); one that had would be held to them.
    monkeypatch.setitem(CATALOG, "p4d.24xlarge", replace(CATALOG["p4d.24xlarge"], network_layers=2))
    assert problems({"network_topology": {"mode": "hard", "tier": 3}}) == [
        "network_topology.tier: got 3 (p4d.24xlarge has 2 network layers); allowed: 1 to 2"]
    assert parse_job_spec({**JOB, "network_topology": {"mode": "hard", "tier": 2}}, CONFIG)


@pytest.mark.parametrize(("topology", "expected"), [
    ({"mode": "hard", "tier": 4}, "network_topology.tier: got 4; allowed: less than or equal to 3"),
    ({"mode": "hard", "tier": 0}, "network_topology.tier: got 0; allowed: greater than or equal to 1"),
    ({"mode": "strict"}, "network_topology.mode: got \"strict\"; allowed: 'none', 'soft' or 'hard'"),
    ({"mode": "hard", "highest_tier": 2}, "network_topology.highest_tier: unknown key; allowed keys here: mode, tier"),
])
def test_each_bad_network_topology_is_one_line(topology, expected):
    assert problems({"network_topology": topology}) == [expected]


# --- the scheduler -------------------------------------------------------------------------------


def test_the_scheduler_runs_the_network_topology_plugin_after_binpack():
    policy = yaml.safe_load(helm_values({})["custom"]["scheduler_config_override"])
    second = [plugin["name"] for plugin in policy["tiers"][1]["plugins"]]
    assert second[-2:] == ["binpack", "network-topology-aware"]
    assert not [p for p in policy["tiers"][0]["plugins"] if p["name"] == "network-topology-aware"]
    # Its defaults stay, normal-pod hypernode binpacking included (the reason is in k8s_charts/volcano.py).
    assert "arguments" not in policy["tiers"][1]["plugins"][-1]


# --- the controller's HyperNode discovery ----------------------------------------------------------


def chart_controller_configmap(values: dict) -> dict:
    """The chart's <release>-controller-configmap for ``values``, as templates/controllers.yaml (v1.15.1) writes it:

        data:
          volcano-controller.conf: |
          {{- if .Values.custom.controller_config_override }}
          {{ toYaml .Values.custom.controller_config_override | nindent 4 }}
          {{- end }}

    ``{{-`` eats the line break before it, so what follows ``|`` is a line of two spaces, then the
    value's YAML indented by four. Helm's toYaml is sigs.k8s.io/yaml's: keys sorted, block style,
    a list not indented under its key, no trailing line break; PyYAML's safe_dump writes the same.
    """
    override = values["custom"].get("controller_config_override")
    conf = ""
    if override:
        to_yaml = yaml.safe_dump(override, sort_keys=True, default_flow_style=False).rstrip("\n")
        conf = "\n  " + "".join(f"\n    {line}" for line in to_yaml.split("\n"))
    manifest = ("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: volcano-controller-configmap\n"
                f"  namespace: volcano-system\ndata:\n  volcano-controller.conf: |{conf}\n")
    return yaml.safe_load(manifest)


def test_the_controller_discovers_hypernodes_from_the_eks_labels_top_first():
    values = helm_values({})
    assert isinstance(values["custom"]["controller_config_override"], dict)  # toYaml of text would be one string
    conf = yaml.safe_load(chart_controller_configmap(values)["data"]["volcano-controller.conf"])
    assert conf == {"networkTopologyDiscovery": [{"source": "label", "enabled": True, "config": {
        "networkTopologyTypes": {"eks": [{"nodeLabel": f"{LAYER}1"}, {"nodeLabel": f"{LAYER}2"},
                                         {"nodeLabel": f"{LAYER}3"}, {"nodeLabel": "kubernetes.io/hostname"}]}}}]}
    assert NETWORK_LAYERS == 3


def label_discovery(conf: dict, nodes: dict[str, dict[str, str]], names: dict[tuple[str, str], str]) -> list[dict]:
    """What label.go (v1.15.1) makes of ``nodes``' labels under ``conf``; ``names`` stands in for its
    random name suffixes, by (label, value).

    parseCfg: each type's list read from its second-to-last entry up to the first, the last dropped;
    generateHyperNodeInfo: per node, entry i is tier i+1, grouped by label value, its members the node
    (tier 1) or the HyperNode one tier down; a node without a label stops there. buildHyperNodes
    (utils.BuildHyperNodeWithTierName, BuildMembers): tierName the label, members sorted and by
    exactMatch, labels the source and the label itself.
    """
    found: dict[str, dict] = {}
    for source in conf["networkTopologyDiscovery"]:
        if source["source"] != "label" or not source["enabled"]:
            continue
        for labels in source["config"]["networkTopologyTypes"].values():
            keys = [entry["nodeLabel"] for entry in labels][-2::-1]
            for node, node_labels in nodes.items():
                member = node
                for i, key in enumerate(keys):
                    if key not in node_labels:
                        break
                    name = names[(key, node_labels[key])]
                    hypernode = found.setdefault(name, {"tier": i + 1, "tierName": key, "members": set(),
                                                        "labels": {SOURCE: "label", key: node_labels[key]}})
                    hypernode["members"].add(member)
                    member = name
    return [{"apiVersion": "topology.volcano.sh/v1alpha1", "kind": "HyperNode",
             "metadata": {"name": name, "labels": info["labels"]},
             "spec": {"tier": info["tier"], "tierName": info["tierName"], "members": [
                 {"type": "Node" if info["tier"] == 1 else "HyperNode", "selector": {"exactMatch": {"name": member}}}
                 for member in sorted(info["members"])]}}
            for name, info in sorted(found.items())]


# Five p4d.24xlarge nodes and a c5.2xlarge system node as EKS labels them (values are per-account
# hashes, e.g. nn-e50490a237cb0f01a): two layer-3 network nodes of two nodes each under one layer-2
# node, a fifth node under another layer-2 node, one layer-1 node above all. c5 has no topology.
TOP, SPINE_A, SPINE_B = "nn-4c1f0a9e27b36d5e8", "nn-7a02d6e9b1c4f3a05", "nn-91e3b7c0d2a4f6e18"
LEAF_A, LEAF_B, LEAF_C = "nn-2b8e4f1a6c9d03e7b", "nn-5d7c2a0e8f1b4c6a9", "nn-c06a1e9d3b7f5a2c4"
NODES = {
    "ip-10-0-64-11.us-west-2.compute.internal": {f"{LAYER}1": TOP, f"{LAYER}2": SPINE_A, f"{LAYER}3": LEAF_A},
    "ip-10-0-64-12.us-west-2.compute.internal": {f"{LAYER}1": TOP, f"{LAYER}2": SPINE_A, f"{LAYER}3": LEAF_A},
    "ip-10-0-65-21.us-west-2.compute.internal": {f"{LAYER}1": TOP, f"{LAYER}2": SPINE_A, f"{LAYER}3": LEAF_B},
    "ip-10-0-65-22.us-west-2.compute.internal": {f"{LAYER}1": TOP, f"{LAYER}2": SPINE_A, f"{LAYER}3": LEAF_B},
    "ip-10-0-66-31.us-west-2.compute.internal": {f"{LAYER}1": TOP, f"{LAYER}2": SPINE_B, f"{LAYER}3": LEAF_C},
    "ip-10-0-0-5.us-west-2.compute.internal": {},
}
NODES = {name: {"kubernetes.io/hostname": name, "node.kubernetes.io/instance-type": "c5.2xlarge" if not labels
                else "p4d.24xlarge", **labels} for name, labels in NODES.items()}


def node(name: str) -> dict:
    return {"type": "Node", "selector": {"exactMatch": {"name": name}}}


def hypernode(name: str) -> dict:
    return {"type": "HyperNode", "selector": {"exactMatch": {"name": name}}}


def expected_hypernode(name: str, tier: int, layer: int, value: str, members: list[dict]) -> dict:
    return {"apiVersion": "topology.volcano.sh/v1alpha1", "kind": "HyperNode",
            "metadata": {"name": name, "labels": {SOURCE: "label", f"{LAYER}{layer}": value}},
            "spec": {"tier": tier, "tierName": f"{LAYER}{layer}", "members": members}}


# Written by hand: tier 1 = layer 3 with the nodes, tier 2 = layer 2, tier 3 = layer 1 (the top).
EXPECTED = [
    expected_hypernode("hypernode-eks-tier1-b4x9k", 1, 3, LEAF_A, [
        node("ip-10-0-64-11.us-west-2.compute.internal"), node("ip-10-0-64-12.us-west-2.compute.internal")]),
    expected_hypernode("hypernode-eks-tier1-m2q7d", 1, 3, LEAF_B, [
        node("ip-10-0-65-21.us-west-2.compute.internal"), node("ip-10-0-65-22.us-west-2.compute.internal")]),
    expected_hypernode("hypernode-eks-tier1-w8z5c", 1, 3, LEAF_C, [node("ip-10-0-66-31.us-west-2.compute.internal")]),
    expected_hypernode("hypernode-eks-tier2-f6n3t", 2, 2, SPINE_A, [
        hypernode("hypernode-eks-tier1-b4x9k"), hypernode("hypernode-eks-tier1-m2q7d")]),
    expected_hypernode("hypernode-eks-tier2-r5j8v", 2, 2, SPINE_B, [hypernode("hypernode-eks-tier1-w8z5c")]),
    expected_hypernode("hypernode-eks-tier3-k7p2h", 3, 1, TOP, [
        hypernode("hypernode-eks-tier2-f6n3t"), hypernode("hypernode-eks-tier2-r5j8v")]),
]


def test_the_discovered_hypernodes_nest_the_eks_layers_and_match_the_hypernode_crd():
    conf = yaml.safe_load(chart_controller_configmap(helm_values({}))["data"]["volcano-controller.conf"])
    names = {(h["spec"]["tierName"], h["metadata"]["labels"][h["spec"]["tierName"]]): h["metadata"]["name"]
             for h in EXPECTED}
    assert label_discovery(conf, NODES, names) == EXPECTED
    validator = _crd_validator(HYPERNODE_CRD, VENDORED_CRDS)
    for obj in EXPECTED:
        validator.validate(obj)
        # The CRD's CEL rules (x-kubernetes-validations on the selector) and the webhook's
        # (webhooks/admission/hypernodes/validate/admit_hypernode.go): one selector kind, a member or more.
        assert all(len(m["selector"].keys() & {"exactMatch", "regexMatch", "labelMatch"}) == 1
                   for m in obj["spec"]["members"]) and obj["spec"]["members"]


def test_the_hypernode_crd_check_catches_a_misspelt_selector():
    wrong = {**EXPECTED[0], "spec": {**EXPECTED[0]["spec"], "members": [
        {"type": "Node", "selector": {"exactSelector": {"name": "ip-10-0-64-11.us-west-2.compute.internal"}}}]}}
    with pytest.raises(jsonschema.ValidationError, match="exactSelector"):
        _crd_validator(HYPERNODE_CRD, VENDORED_CRDS).validate(wrong)
