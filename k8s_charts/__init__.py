"""cdk8s charts for the platform's Kubernetes objects (etcd, Volcano, storage, jobs)."""

import contextlib

from k8s_charts.node_runtime import NodeRuntimeMissing, select_node

# Before any chart module imports cdk8s, whose import starts jsii's Node process. Without a
# supported Node the entry points (trainctl, python -m k8s_charts) call select_node() again
# and print its one line.
with contextlib.suppress(NodeRuntimeMissing):
    select_node()
