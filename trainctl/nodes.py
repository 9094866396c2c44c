"""``trainctl nodes``: the cluster's accelerated nodes and their health, as the platform sees it.

Health comes from the node check (training/node_check: its taint, ``NODE_HEALTH_LABEL`` and
``NODE_FAILED_CHECK_LABEL``) and from the node conditions EKS's node monitoring agent reports
(``AcceleratedHardwareReady``, ``KernelReady`` ... False: node auto repair acts on them).
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass

from config.catalog import ACCELERATED_ROLE, INSTANCE_TYPE_LABEL, NODE_GROUP_LABEL, NODE_ROLE_LABEL
from training.contract import NODE_CHECK_TAINT, NODE_FAILED, NODE_FAILED_CHECK_LABEL, NODE_HEALTH_LABEL, NODE_PASSED

CHECKING, UNCHECKED = "checking", "unchecked"


@dataclass(frozen=True)
class NodeRow:
    name: str
    group: str | None
    instance: str | None
    check: str  # passed | failed | checking | unchecked
    failed_check: str | None
    ready: bool
    schedulable: bool
    problems: list[str]  # the monitoring agent's conditions that say something is wrong
    age_s: int

    @property
    def health(self) -> str:
        if self.check == NODE_FAILED:
            return f"failed: {self.failed_check or '?'}"
        return self.check


def node_row(node, now: datetime.datetime) -> NodeRow:
    """One row from a kubernetes V1Node."""
    labels = node.metadata.labels or {}
    tainted = any(t.key == NODE_CHECK_TAINT for t in node.spec.taints or [])
    verdict = labels.get(NODE_HEALTH_LABEL)
    if verdict == NODE_FAILED:
        check = NODE_FAILED
    elif tainted:
        check = CHECKING
    else:
        check = NODE_PASSED if verdict == NODE_PASSED else UNCHECKED
    conditions = (node.status.conditions if node.status else None) or []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    # The monitoring agent's conditions are "...Ready" types, True when healthy; the kubelet's pressures
    # are True when something is wrong.
    problems = sorted(f"{c.type}: {c.reason or c.status}" for c in conditions
                      if (c.type != "Ready" and c.type.endswith("Ready") and c.status == "False")
                      or (c.type.endswith("Pressure") and c.status == "True"))
    created = node.metadata.creation_timestamp or now
    return NodeRow(name=node.metadata.name, group=labels.get(NODE_GROUP_LABEL), instance=labels.get(INSTANCE_TYPE_LABEL),
                   check=check, failed_check=labels.get(NODE_FAILED_CHECK_LABEL) if check == NODE_FAILED else None,
                   ready=ready, schedulable=not (node.spec.unschedulable or False), problems=problems,
                   age_s=int((now - created).total_seconds()))


def accelerated_nodes(core) -> list[NodeRow]:
    now = datetime.datetime.now(datetime.timezone.utc)
    nodes = core.list_node(label_selector=f"{NODE_ROLE_LABEL}={ACCELERATED_ROLE}").items
    return sorted((node_row(node, now) for node in nodes), key=lambda r: (r.group or "", r.name))


def _age(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def format_rows(rows: list[NodeRow]) -> str:
    if not rows:
        return "no accelerated nodes (groups at zero scale up when a job asks for them)"
    header = ("NODE", "GROUP", "INSTANCE", "HEALTH", "READY", "SCHEDULING", "AGE", "CONDITIONS")
    table = [header] + [(r.name, r.group or "-", r.instance or "-", r.health, "yes" if r.ready else "no",
                         "on" if r.schedulable else "cordoned", _age(r.age_s), ", ".join(r.problems) or "-")
                        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)),
                                row[-1]]).rstrip() for row in table)


def as_dicts(rows: list[NodeRow]) -> list[dict]:
    return [{**asdict(row), "health": row.health} for row in rows]
