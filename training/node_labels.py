"""``python -m training.node_labels PATH``: the training pod's init container writes its node's network
labels (``contract.NETWORK_NODE_LABEL_PREFIX``), as a JSON object, to PATH; the agent reads them
(``contract.NODE_LABELS_FILE_ENV``) and takes a rank next to its network neighbours (training/launcher/topology.py).

Why an init container: the downward API cannot hand a pod its node's labels (Kubernetes 1.35's
PodTopologyLabelsAdmission copies only topology.kubernetes.io/zone and region; KEP-4742), so something
must read the Node. Only this container holds a token (a projected, audience-bound one, k8s_charts/
job_charts.py); the training program, which may be the user's own, never does. The token's account may
get Nodes and nothing else: RBAC cannot narrow a read to one Node.

It never holds up a job: without the labels (a type EC2 gives no topology, a read that failed) it
writes an empty object and the ranks ignore the network.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from training.contract import NETWORK_NODE_LABEL_PREFIX, NODE_NAME_ENV
from training.launcher.topology import network_of


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m training.node_labels PATH", file=sys.stderr)
        return 2
    node = os.environ.get(NODE_NAME_ENV, "")
    labels: dict[str, str] = {}
    try:
        from training.node_check.node_api import NodeApi

        read = NodeApi.connect().node(node)
        labels = {key: value for key, value in ((read.get("metadata") or {}).get("labels") or {}).items()
                  if key.startswith(NETWORK_NODE_LABEL_PREFIX)}
    except Exception as error:  # noqa: BLE001 - any failure (the API, the config) leaves the order alone
        print(f"node-labels: could not read node {node!r} ({str(error).splitlines()[0][:300]}); "
              "its rank ignores the network", file=sys.stderr)
    Path(args[0]).write_text(json.dumps(labels, sort_keys=True))
    print(json.dumps({"event": "node_network", "node": node, "network": list(network_of(labels))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
