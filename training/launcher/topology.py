"""Ranks in network order: nodes under the same network node get neighbouring ranks.

NCCL's rings (and the Neuron runtime's) run through the nodes in rank order, so every pair of
neighbouring ranks on different network nodes sends the ring's traffic through the layer above.
EKS labels each node with the network nodes above it, top down (``contract.NETWORK_NODE_LABEL_PREFIX``).
Sorting the nodes by that path puts every network node's nodes next to each other, at every layer at
once (the network is a tree: nodes under one layer-3 network node share its layer 2 and layer 1), so a
ring crosses each layer as few times as a ring can: once into and once out of each group.

Torch-free: the rendezvous (:mod:`training.launcher.rendezvous`) orders a round's members with it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Mapping, Sequence, TypeVar

from training.contract import NETWORK_NODE_LABEL_PREFIX, NODE_LABELS_FILE_ENV

log = logging.getLogger(__name__)

Network = tuple[str, ...]  # a node's network nodes, top down; () when unknown
T = TypeVar("T")


def network_of(labels: Mapping[str, str]) -> Network:
    """The network nodes above a node, top down, from its labels: layer 1, 2, … while they go on."""
    path: list[str] = []
    while value := labels.get(f"{NETWORK_NODE_LABEL_PREFIX}{len(path) + 1}"):
        path.append(str(value))
    return tuple(path)


def this_node_network(environ: Mapping[str, str] = os.environ) -> Network:
    """This node's network, from the labels file the pod's init container wrote (NODE_LABELS_FILE_ENV);
    () where there is none: a node type without topology, a backend that has no Node objects."""
    path = environ.get(NODE_LABELS_FILE_ENV)
    if not path:
        return ()
    try:
        with open(path, encoding="utf-8") as labels:
            network = network_of(json.load(labels))
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("could not read this node's labels from %s (%s); its rank ignores the network", path, exc)
        return ()
    if not network:
        log.info("this node carries no %s* labels; its rank ignores the network", NETWORK_NODE_LABEL_PREFIX)
    return network


def network_order(nodes: Sequence[T], network: Callable[[T], Network], first: T | None = None) -> list[T]:
    """``nodes`` sorted by their network, nodes of unknown network after, ties in their given order;
    then turned so that ``first`` (a node that must keep rank 0) leads. Turning a ring changes none of
    its crossings, and where no node's network is known the order is the one given."""
    known = sorted((n for n in nodes if network(n)), key=network)  # stable: ties keep their order
    ordered = known + [n for n in nodes if not network(n)]
    if first is not None and first in ordered:
        at = ordered.index(first)
        ordered = ordered[at:] + ordered[:at]
    return ordered


def ring_crossings(nodes: Sequence[T], network: Callable[[T], Network], layer: int) -> int:
    """How many neighbouring pairs of a ring through ``nodes`` (the last next to the first) sit under
    different network nodes of ``layer`` (1: the top). Pairs where either network is unknown count."""
    if len(nodes) < 2:
        return 0

    def at(node: T) -> str | None:
        path = network(node)
        return path[layer - 1] if len(path) >= layer else None

    pairs = zip(nodes, [*nodes[1:], nodes[0]], strict=True)
    return sum(1 for a, b in pairs if at(a) is None or at(a) != at(b))
