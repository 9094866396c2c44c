"""Which charts make up the platform and a job; shared by the CLI renderer and the cluster stack."""

from __future__ import annotations

from typing import Any

from constructs import Construct

from config import PlatformConfig
from config.catalog import Accelerator
from k8s_charts.job_charts import NcclCheckChart, TrainingJobChart
from config.job_spec import JobSpec
from k8s_charts.node_check import NodeCheckChart
from k8s_charts.platform_charts import (
    EtcdCertificatesChart, EtcdChart, LustreVolumeValues, NamespacesChart, SchedulingChart, StorageChart, StorageClassChart,
)

# The storage stack's CfnOutput keys (stacks/storage_stack.py).
_OUTPUT_KEYS = {"file_system_id": "FileSystemId", "dns_name": "FileSystemDnsName", "mount_name": "FileSystemMountName"}


# The platform's charts, by id: each id is also the chart's file in dist/.
PLATFORM_CHARTS = {"namespaces": NamespacesChart, "storage-class": StorageClassChart,
                   "etcd-certificates": EtcdCertificatesChart, "etcd": EtcdChart, "scheduling": SchedulingChart}
STORAGE_CHART = "storage"
NODE_CHECK_CHART = "node-check"  # with cluster.node_check.enabled
DATA_PREP_CHART = "prepare-imagenet"


def render_platform(scope: Construct, config: PlatformConfig, volume: LustreVolumeValues | None) -> None:
    for chart_id, chart in PLATFORM_CHARTS.items():
        chart(scope, chart_id, config)
    if config.cluster.node_check.enabled:
        NodeCheckChart(scope, NODE_CHECK_CHART, config)
    if volume is not None:
        StorageChart(scope, STORAGE_CHART, config, volume)


def job_chart_ids(config: PlatformConfig, spec: JobSpec) -> list[str]:
    """The charts (and dist/ files) a job renders: the training job, and on NVIDIA its NCCL check."""
    nvidia = spec.group(config).instance.accelerator is Accelerator.NVIDIA
    return [spec.name, *([f"{spec.name}-nccl-check"] if nvidia else [])]


def check_job_names(config: PlatformConfig, specs: list[tuple[str, JobSpec]]) -> None:
    """Each job's charts need ids (dist/ file names) of their own: not the platform's, the data
    preparation job's or another job's. ``specs``: each spec's file and the spec, in order."""
    taken = {chart_id: "the platform's" for chart_id in [*PLATFORM_CHARTS, STORAGE_CHART, NODE_CHECK_CHART]}
    taken[DATA_PREP_CHART] = "the data preparation job's"
    for path, spec in specs:
        for chart_id in job_chart_ids(config, spec):
            if chart_id in taken:
                raise ValueError(f"--job {path}: name: got {spec.name!r}, whose manifest {chart_id}.yaml would "
                                 f"overwrite {taken[chart_id]}; allowed: a name no other manifest uses")
            taken[chart_id] = f"the one of --job {path}"


def render_job(scope: Construct, config: PlatformConfig, spec: JobSpec) -> None:
    training, *check = job_chart_ids(config, spec)
    TrainingJobChart(scope, training, config, spec)
    for chart_id in check:
        NcclCheckChart(scope, chart_id, config, spec)


def read_outputs(path: str) -> dict[str, Any]:
    """The JSON ``cdk deploy --outputs-file`` wrote, or one line saying what is wrong with the file."""
    import json
    from pathlib import Path

    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--outputs: {path} is not JSON ({exc.msg}, line {exc.lineno} column {exc.colno}); allowed: "
                         "the file `cdk deploy --outputs-file` writes") from None


def volume_from_outputs(outputs: dict[str, Any], config: PlatformConfig) -> LustreVolumeValues:
    """The FSx values from ``cdk deploy --outputs-file``: {stack name: {output key: value}}."""
    stack = config.stack_name("storage")
    if stack not in outputs:
        raise KeyError(f"--outputs: no stack {stack!r} in the file; deploy it with --outputs-file first")
    found = outputs[stack]
    missing = [key for key in _OUTPUT_KEYS.values() if key not in found]
    if missing:
        raise KeyError(f"--outputs: stack {stack!r} lacks {', '.join(missing)}")
    return LustreVolumeValues(**{field: found[key] for field, key in _OUTPUT_KEYS.items()},
                              capacity_gib=config.fsx.storage_capacity_gib)


def manifests(scope: Construct) -> dict[str, list[dict]]:
    """Every chart under ``scope`` as plain objects, keyed by the chart's id (its dist/ file name)."""
    from cdk8s import Chart

    return {child.node.id: child.to_json() for child in scope.node.children if isinstance(child, Chart)}
