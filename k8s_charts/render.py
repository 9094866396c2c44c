"""Which charts make up the platform and a job; shared by the CLI renderer and the cluster stack."""

from __future__ import annotations

from typing import Any

from constructs import Construct

from config import PlatformConfig
from config.catalog import Accelerator
from k8s_charts.job_charts import NcclCheckChart, TrainingJobChart
from k8s_charts.job_spec import JobSpec
from k8s_charts.platform_charts import (
    EtcdCertificatesChart, EtcdChart, LustreVolumeValues, NamespacesChart, SchedulingChart, StorageChart, StorageClassChart,
)

# The storage stack's CfnOutput keys (stacks/storage_stack.py).
_OUTPUT_KEYS = {"file_system_id": "FileSystemId", "dns_name": "FileSystemDnsName", "mount_name": "FileSystemMountName"}


def render_platform(scope: Construct, config: PlatformConfig, volume: LustreVolumeValues | None) -> None:
    NamespacesChart(scope, "namespaces", config)
    StorageClassChart(scope, "storage-class", config)
    EtcdCertificatesChart(scope, "etcd-certificates", config)
    EtcdChart(scope, "etcd", config)
    SchedulingChart(scope, "scheduling", config)
    if volume is not None:
        StorageChart(scope, "storage", config, volume)


def render_job(scope: Construct, config: PlatformConfig, spec: JobSpec) -> None:
    TrainingJobChart(scope, spec.name, config, spec)
    if spec.group(config).instance.accelerator is Accelerator.NVIDIA:
        NcclCheckChart(scope, f"{spec.name}-nccl-check", config, spec)


def volume_from_outputs(outputs: dict[str, Any], config: PlatformConfig) -> LustreVolumeValues:
    """The FSx values from ``cdk deploy --outputs-file``: {stack name: {output key: value}}."""
    stack = f"{config.name_prefix}-storage"
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
