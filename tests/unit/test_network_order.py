"""Ranks in network order (training/launcher/topology.py), on a set of EKS nodes' labels.

A ring through the nodes in rank order sends its traffic across a network node's boundary at every
pair of neighbours under different network nodes. Taken in the order the pods joined, a 24-node ring
crosses layer 3 at almost every pair; in network order it enters and leaves each network node once.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from training.contract import NODE_LABELS_FILE_ENV, network_node_label
from training.launcher.topology import network_of, network_order, ring_crossings, this_node_network

DATA = json.loads((REPO / "tests" / "unit" / "data" / "eks_network_labels.json").read_text())
NODES = [node["name"] for node in DATA["nodes"]]  # in the order their pods joined
NETWORK = {node["name"]: network_of(node["labels"]) for node in DATA["nodes"]}


def crossings(order: list[str]) -> dict[int, int]:
    return {layer: ring_crossings(order, NETWORK.get, layer) for layer in (3, 2, 1)}


def groups(layer: int) -> int:
    return len({path[:layer] for path in NETWORK.values()})


def test_a_node_s_network_is_its_layers_top_down():
    labels = DATA["nodes"][0]["labels"]
    assert NETWORK[NODES[0]] == tuple(labels[network_node_label(layer)] for layer in (1, 2, 3))
    assert network_of({"kubernetes.io/hostname": "ip-10-1-16-10"}) == ()  # a type EC2 gives no topology
    # Numbered from the top and read while they go on: a missing layer 2 leaves layer 3 unplaceable.
    assert network_of({network_node_label(1): "nn-a", network_node_label(3): "nn-c"}) == ("nn-a",)
    assert network_of({network_node_label(layer): f"nn-{layer}" for layer in (1, 2, 3, 4)}) == (
        "nn-1", "nn-2", "nn-3", "nn-4")  # p6-b200 and p6-b300 have a fourth layer


def test_in_network_order_a_ring_enters_and_leaves_each_network_node_once():
    before = crossings(NODES)
    after = crossings(network_order(NODES, NETWORK.get))
    assert (groups(3), groups(2), groups(1)) == (6, 3, 2)
    # The pods' order crosses layer 3 at 23 of 24 pairs; network order crosses it only between the 6
    # layer-3 network nodes, which no ring can do with fewer, and the same at layers 2 and 1.
    assert before == {3: 23, 2: 16, 1: 12}
    assert after == {3: groups(3), 2: groups(2), 1: groups(1)}


def test_rank_0_keeps_its_node_and_the_ring_keeps_its_crossings():
    ordered = network_order(NODES, NETWORK.get)
    kept = NODES[7]
    turned = network_order(NODES, NETWORK.get, first=kept)
    assert turned[0] == kept and sorted(turned) == sorted(NODES)
    assert crossings(turned) == crossings(ordered)


def test_nodes_without_a_network_follow_and_without_any_the_order_is_unchanged():
    unknown = ["cpu-a", "cpu-b"]
    mixed = [unknown[0], *NODES[:6], unknown[1]]
    ordered = network_order(mixed, lambda n: NETWORK.get(n, ()))
    assert ordered[-2:] == unknown and sorted(ordered[:6], key=NETWORK.get) == ordered[:6]
    plain = ["n3", "n1", "n2"]
    assert network_order(plain, lambda n: ()) == plain
    assert network_order(plain, lambda n: (), first="n1") == ["n1", "n2", "n3"]


def test_the_agent_reads_its_node_s_labels_from_the_file_its_init_container_wrote(tmp_path, caplog):
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps(DATA["nodes"][3]["labels"]))
    assert this_node_network({NODE_LABELS_FILE_ENV: str(labels)}) == NETWORK[NODES[3]]
    assert this_node_network({}) == ()  # a backend without Node objects: local, Slurm, Batch
    labels.write_text(json.dumps({"kubernetes.io/hostname": "g5"}))
    with caplog.at_level(logging.INFO, logger="training.launcher.topology"):
        assert this_node_network({NODE_LABELS_FILE_ENV: str(labels)}) == ()
    assert "carries no topology.k8s.aws/network-node-layer-* labels" in caplog.text
    labels.write_text("not json")
    assert this_node_network({NODE_LABELS_FILE_ENV: str(labels)}) == ()
    assert this_node_network({NODE_LABELS_FILE_ENV: str(tmp_path / "missing.json")}) == ()
    assert caplog.text.count("its rank ignores the network") == 3


@pytest.mark.parametrize("size", [1, 2])
def test_tiny_rings(size):
    assert ring_crossings(NODES[:size], NETWORK.get, 3) == (0 if size == 1 else 2 * (NETWORK[NODES[0]] != NETWORK[NODES[1]]))


def test_the_init_container_writes_its_node_s_network_labels_and_never_fails_the_pod(tmp_path):
    """``python -m training.node_labels`` against a stand-in API server: it keeps the network labels of
    its own node, and when the read fails (no such node, no API) it writes {} and exits 0."""
    from tests.trainctl_fixtures import kubeconfig
    from tests.unit.test_trainctl_kube import FakeApiServer
    from training.contract import NODE_LABELS_MODULE, NODE_NAME_ENV

    def init_container(node_name: str) -> tuple[subprocess.CompletedProcess, dict]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KUBERNETES_"))}
        env |= {"KUBECONFIG": kubeconfig(tmp_path / "kubeconfig", server.url), NODE_NAME_ENV: node_name}
        written = tmp_path / "labels.json"
        done = subprocess.run([sys.executable, "-m", NODE_LABELS_MODULE, str(written)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
        return done, json.loads(written.read_text())

    server = FakeApiServer()
    try:
        node = DATA["nodes"][5]
        server.nodes[node["name"]] = {"kind": "Node", "apiVersion": "v1",
                                      "metadata": {"name": node["name"], "labels": node["labels"]}}
        done, labels = init_container(node["name"])
        assert done.returncode == 0, done.stderr
        assert set(labels) == {network_node_label(layer) for layer in (1, 2, 3)}  # the network's only
        assert network_of(labels) == NETWORK[node["name"]]
        assert [(method, path) for method, path, *_ in server.requests] == [("GET", f"/api/v1/nodes/{node['name']}")]

        done, labels = init_container("ip-10-9-9-9.us-west-2.compute.internal")
        assert done.returncode == 0 and labels == {}
        assert "its rank ignores the network" in done.stderr
    finally:
        server.httpd.shutdown()


def test_pods_on_types_with_a_topology_hand_the_agent_their_node_s_labels_and_others_do_not():
    from tests.unit.test_charts import RENDERED, container, the_job
    from tests.unit.test_network_topology import config_with, rendered_job

    pod = the_job(RENDERED, "resnet50-imagenet")["spec"]["tasks"][0]["template"]["spec"]
    (init,) = [i for i in pod["initContainers"] if i["name"] == "node-labels"]
    assert init["command"] == ["python", "-m", "training.node_labels", "/platform-node/labels.json"]
    assert init["env"] == [{"name": "PLATFORM_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    trainer = container(the_job(RENDERED, "resnet50-imagenet"))
    assert {"name": NODE_LABELS_FILE_ENV, "value": "/platform-node/labels.json"} in trainer["env"]
    assert {"name": "node-info", "mountPath": "/platform-node", "readOnly": True} in trainer["volumeMounts"]
    assert not any(m["mountPath"].startswith("/var/run/secrets") for m in trainer["volumeMounts"])

    plain = rendered_job(config_with("g5.12xlarge"), {"node_group": "g"})["spec"]["tasks"][0]["template"]["spec"]
    assert "node-labels" not in [i["name"] for i in plain.get("initContainers", [])]
    assert NODE_LABELS_FILE_ENV not in [e["name"] for e in plain["containers"][0]["env"]]
    assert {v["name"] for v in plain["volumes"]}.isdisjoint({"node-info", "node-labels-token"})
