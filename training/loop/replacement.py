"""Replacing a straggler's node (metrics.straggler_policy=replace; issue 50, item 4).

Every rank reads the same reduced step times at a report, so every rank names the same straggler
(stragglers.py) and reaches the same decision here, with no message between them. At that step the
ranks write a checkpoint together (the stop checkpoint of the leaving node), then the straggler's
pod (all its ranks) taints its node and leaves (``EXIT_REPLACE_NODE``), and the others leave their
group and wait for the round without it, which starts from the step they hold in memory: no step
is trained again. The job's controller starts another pod, which the taint keeps off that node.

Never more than one at a time: after a replacement, none until the job has its nodes back (the
new pod joined). Never below the job's --nnodes minimum.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from training.contract import MIN_NODES_ENV, NODE_NAME_ENV, STRAGGLER_TAINT

log = logging.getLogger(__name__)
STRAGGLER_TAINT_VALUE = "true"


@dataclass
class Decision:
    pod: str  # the pod (node) that leaves
    rank: int  # the straggler named
    nodes: int  # the job's nodes when it was decided


class Replacement:
    """The decision, the same on every rank; ``pending`` until the ranks act on it at that step."""

    def __init__(self, policy: str, min_nodes: int | None = None) -> None:
        self.policy = policy
        self.min_nodes = min_nodes if min_nodes is not None else int(os.environ.get(MIN_NODES_ENV, "1"))
        self.pending: Decision | None = None
        self._awaiting_nodes: int | None = None  # a replacement is under way until the job has this many again
        self._refused_logged = False

    def consider(self, named: list[tuple[int, float]], pods: list[str], nodes: int) -> Decision | None:
        """After a report that named ``named`` (rank, times the median): replace the slowest one's node?
        ``pods``: each rank's pod; ``nodes``: the nodes (pods) in the job now."""
        if self.policy != "replace" or not named or self.pending is not None:
            return None
        if self._awaiting_nodes is not None:
            if nodes < self._awaiting_nodes:
                log.info("straggler not replaced: the last replacement is under way (%d of %d nodes)", nodes,
                         self._awaiting_nodes)
                return None
            self._awaiting_nodes = None
        if nodes - 1 < self.min_nodes:
            if not self._refused_logged:
                log.warning("straggler not replaced: the job would go below its minimum of %d node(s)", self.min_nodes)
                self._refused_logged = True
            return None
        rank = max(named, key=lambda item: item[1])[0]
        self.pending = Decision(pods[rank], rank, nodes)
        self._awaiting_nodes = nodes
        return self.pending

    def take(self) -> Decision | None:
        decision, self.pending = self.pending, None
        return decision


def taint_own_node() -> bool:
    """Taint the node this pod runs on so that no pod lands there again (the job's replacement included).
    Through the pod's service account token; the platform's policy lets it taint its own node only."""
    from training.node_check.node_api import NodeApi

    node = os.environ.get(NODE_NAME_ENV)
    if not node:
        log.error("this node cannot be tainted: %s is not set (the job's pods name their node)", NODE_NAME_ENV)
        return False
    added = NodeApi.connect().add_taint(node, STRAGGLER_TAINT, STRAGGLER_TAINT_VALUE, "NoSchedule")
    log.warning("node %s %s %s: no pod lands there again", node, "tainted" if added else "already has", STRAGGLER_TAINT)
    return True
