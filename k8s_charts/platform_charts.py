"""Charts deployed with the platform: etcd for rendezvous, the Volcano queue and priority, the FSx volume."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cdk8s import Chart
from constructs import Construct

from config import PlatformConfig
from config.catalog import NODE_ROLE_LABEL, SYSTEM_ROLE
from k8s_charts.job_spec import FSX_MOUNT
from k8s_charts.objects import k8s_object
from training.launch import ETCD_CLIENT_PORT, ETCD_PEER_PORT
from training.local_cluster import etcd_arguments

ETCD_NAME = "etcd"
# Training pods run as this service account; the cluster gives it access to the data bucket's prefixes.
TRAINER_SERVICE_ACCOUNT = "trainer"
FSX_CLAIM = "fsx"
FSX_CSI_DRIVER = "fsx.csi.aws.com"
EBS_CSI_DRIVER = "ebs.csi.aws.com"
ETCD_DATA_DIR = "/var/lib/etcd"


def etcd_endpoint(config: PlatformConfig) -> str:
    """The stable in-cluster address torchrun's --rdzv-endpoint points at."""
    return f"{ETCD_NAME}.{config.jobs.platform_namespace}.svc.cluster.local:{ETCD_CLIENT_PORT}"


def system_node_selector() -> dict[str, str]:
    return {NODE_ROLE_LABEL: SYSTEM_ROLE}


def _metadata(name: str, namespace: str | None = None, **labels: str) -> dict:
    metadata = {"name": name, "labels": {"app.kubernetes.io/part-of": "training-platform", **labels}}
    if namespace:
        metadata["namespace"] = namespace
    return metadata


class NamespacesChart(Chart):
    """The platform's namespace (etcd), the jobs' namespace and its trainer service account."""

    def __init__(self, scope: Construct, id: str, config: PlatformConfig):
        super().__init__(scope, id)
        namespaces = {name: k8s_object(self, name, api_version="v1", kind="Namespace", metadata=_metadata(name))
                      for name in (config.jobs.platform_namespace, config.jobs.namespace)}
        account = k8s_object(self, "trainer", api_version="v1", kind="ServiceAccount",
                             metadata=_metadata(TRAINER_SERVICE_ACCOUNT, config.jobs.namespace),
                             automountServiceAccountToken=False)
        account.add_dependency(namespaces[config.jobs.namespace])


class EtcdChart(Chart):
    """One etcd 3.5 member (v3 API, short Raft timing for 1 s leases), the rendezvous store of every job.

    Running jobs outlive it being away (training.rendezvous: measured through 20 s and 60 s
    outages without a pause, and a restart without its data costs one re-rendezvous and no
    step), so one member is enough and its data may live in an emptyDir; set
    ``jobs.etcd.persistent_volume_gib`` to keep it on a gp3 volume across pod restarts. A
    volume is bound to one AZ: if the only system node of that AZ goes, etcd waits Pending for
    a node there, longer than jobs wait for it. cluster-autoscaler is told not to evict it
    when it scales the system nodes down. No PodDisruptionBudget: with one member it could only
    block node drains, and a drain costs the jobs a brief outage they ride out.
    """

    def __init__(self, scope: Construct, id: str, config: PlatformConfig):
        super().__init__(scope, id, namespace=config.jobs.platform_namespace)
        namespace = config.jobs.platform_namespace
        labels = {"app.kubernetes.io/name": ETCD_NAME}
        # Listen on every interface; clients only ever use the Service name.
        args = etcd_arguments(ETCD_NAME, ETCD_DATA_DIR, ETCD_CLIENT_PORT, ETCD_PEER_PORT, listen_host="0.0.0.0",
                              client_host=f"{ETCD_NAME}.{namespace}.svc.cluster.local", peer_host="127.0.0.1")
        etcd = config.jobs.etcd
        volume = ({"name": "data", "persistentVolumeClaim": {"claimName": f"{ETCD_NAME}-data"}}
                  if etcd.persistent_volume_gib else {"name": "data", "emptyDir": {}})
        if etcd.persistent_volume_gib:
            k8s_object(self, "data", api_version="v1", kind="PersistentVolumeClaim",
                      metadata=_metadata(f"{ETCD_NAME}-data", namespace, **labels),
                      spec={"accessModes": ["ReadWriteOnce"], "storageClassName": etcd.storage_class,
                            "resources": {"requests": {"storage": f"{etcd.persistent_volume_gib}Gi"}}})
        probe = {"httpGet": {"path": "/health", "port": ETCD_CLIENT_PORT}, "periodSeconds": 5, "timeoutSeconds": 2}
        k8s_object(self, "deployment", api_version="apps/v1", kind="Deployment",
                  metadata=_metadata(ETCD_NAME, namespace, **labels),
                  spec={
                      "replicas": 1,
                      # One member at a time: two would be two separate clusters.
                      "strategy": {"type": "Recreate"},
                      "selector": {"matchLabels": labels},
                      "template": {
                          "metadata": {"labels": {**labels, "app.kubernetes.io/part-of": "training-platform"},
                                       "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}},
                          "spec": {
                              "nodeSelector": system_node_selector(),
                              "priorityClassName": "system-cluster-critical",
                              "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "fsGroup": 65532,
                                                  "seccompProfile": {"type": "RuntimeDefault"}},
                              "containers": [{
                                  "name": ETCD_NAME,
                                  "image": config.versions.etcd_image,
                                  "command": ["etcd"],
                                  "args": args,
                                  "ports": [{"name": "client", "containerPort": ETCD_CLIENT_PORT},
                                            {"name": "peer", "containerPort": ETCD_PEER_PORT}],
                                  "readinessProbe": {**probe, "initialDelaySeconds": 2},
                                  "livenessProbe": {**probe, "initialDelaySeconds": 15, "failureThreshold": 6},
                                  "resources": {"requests": {"cpu": "250m", "memory": "256Mi"},
                                                "limits": {"memory": "1Gi"}},
                                  "securityContext": {"allowPrivilegeEscalation": False,
                                                      "readOnlyRootFilesystem": True,
                                                      "capabilities": {"drop": ["ALL"]}},
                                  "volumeMounts": [{"name": "data", "mountPath": ETCD_DATA_DIR}],
                              }],
                              "volumes": [volume],
                          },
                      },
                  })
        k8s_object(self, "service", api_version="v1", kind="Service",
                  metadata=_metadata(ETCD_NAME, namespace, **labels),
                  spec={"selector": labels,
                        "ports": [{"name": "client", "port": ETCD_CLIENT_PORT, "targetPort": ETCD_CLIENT_PORT}]})


class SchedulingChart(Chart):
    """The Volcano queue jobs go to, and the PriorityClass their pods run with."""

    def __init__(self, scope: Construct, id: str, config: PlatformConfig):
        super().__init__(scope, id)
        queue, priority = config.jobs.queue, config.jobs.priority_class
        k8s_object(self, "queue", api_version="scheduling.volcano.sh/v1beta1", kind="Queue",
                  metadata=_metadata(queue.name),
                  spec={"weight": queue.weight, "reclaimable": queue.reclaimable})
        k8s_object(self, "priority", api_version="scheduling.k8s.io/v1", kind="PriorityClass",
                  metadata=_metadata(priority.name), value=priority.value, globalDefault=False,
                  preemptionPolicy="PreemptLowerPriority",
                  description="Training jobs of the platform's queue")


class StorageClassChart(Chart):
    """The encrypted gp3 StorageClass the platform's own volumes (etcd's data) come from.

    Served by the EBS CSI driver add-on (``ebs.csi.aws.com``). A volume is created in the AZ of
    the node its pod is first scheduled to (WaitForFirstConsumer), and deleted with its claim:
    it holds rendezvous state, never training data.
    """

    def __init__(self, scope: Construct, id: str, config: PlatformConfig):
        super().__init__(scope, id)
        k8s_object(self, "gp3", api_version="storage.k8s.io/v1", kind="StorageClass",
                   metadata=_metadata(config.jobs.etcd.storage_class),
                   provisioner=EBS_CSI_DRIVER, parameters={"type": "gp3", "encrypted": "true"},
                   reclaimPolicy="Delete", volumeBindingMode="WaitForFirstConsumer", allowVolumeExpansion=True)


def platform_check_name(config: PlatformConfig) -> str:
    """``platform-check-<hash of the config>``: a config that changes the platform gets a new check."""
    # Not the pipeline section: a stage deploys the same platform as a direct deploy.
    digest = hashlib.sha256(config.model_dump_json(exclude={"pipeline"}).encode()).hexdigest()[:10]
    return f"platform-check-{digest}"


class PlatformCheckChart(Chart):
    """A one-pod Volcano Job, in the jobs' queue and namespace, that asks etcd for its health.

    The cluster stack applies it, and waits for it to complete, on its first deploy and on
    every deploy that changes the config: a platform that deploys but cannot schedule a job
    through Volcano, or whose jobs cannot reach the rendezvous store, fails its deploy (and, in
    a pipeline, never reaches the next approval). It runs ``etcdctl`` from the pinned etcd image
    on a system node.
    """

    def __init__(self, scope: Construct, id: str, config: PlatformConfig):
        super().__init__(scope, id)
        endpoint = f"http://{etcd_endpoint(config)}"
        k8s_object(self, "job", api_version="batch.volcano.sh/v1alpha1", kind="Job",
                   metadata=_metadata(platform_check_name(config), config.jobs.namespace),
                   spec={
                       "schedulerName": "volcano",
                       "queue": config.jobs.queue.name,
                       "priorityClassName": config.jobs.priority_class.name,
                       "minAvailable": 1,
                       "maxRetry": 3,
                       "ttlSecondsAfterFinished": 3600,
                       "tasks": [{"name": "check", "replicas": 1, "template": {"spec": {
                           "restartPolicy": "Never",
                           "automountServiceAccountToken": False,
                           "nodeSelector": system_node_selector(),
                           "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                               "seccompProfile": {"type": "RuntimeDefault"}},
                           "containers": [{
                               "name": "etcd-health",
                               "image": config.versions.etcd_image,
                               "command": ["etcdctl", f"--endpoints={endpoint}", "--command-timeout=10s",
                                           "endpoint", "health"],
                               "resources": {"requests": {"cpu": "50m", "memory": "64Mi"},
                                             "limits": {"memory": "128Mi"}},
                               "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                   "capabilities": {"drop": ["ALL"]}},
                           }],
                       }}}],
                   })


@dataclass(frozen=True)
class LustreVolumeValues:
    """What the static PersistentVolume needs; from the storage stack (tokens or its outputs)."""

    file_system_id: str
    dns_name: str
    mount_name: str
    capacity_gib: int


class StorageChart(Chart):
    """A static PersistentVolume bound to the platform's own FSx for Lustre file system, and its claim."""

    def __init__(self, scope: Construct, id: str, config: PlatformConfig, volume: LustreVolumeValues):
        super().__init__(scope, id)
        namespace = config.jobs.namespace
        pv_name = f"{config.name_prefix}-fsx"
        capacity = f"{volume.capacity_gib}Gi"
        k8s_object(self, "volume", api_version="v1", kind="PersistentVolume",
                  metadata=_metadata(pv_name),
                  spec={
                      "capacity": {"storage": capacity},
                      "volumeMode": "Filesystem",
                      "accessModes": ["ReadWriteMany"],
                      # Deleting the claim must never touch the file system.
                      "persistentVolumeReclaimPolicy": "Retain",
                      "storageClassName": "",
                      "mountOptions": ["flock"],
                      "csi": {"driver": FSX_CSI_DRIVER, "volumeHandle": volume.file_system_id,
                              "volumeAttributes": {"dnsname": volume.dns_name, "mountname": volume.mount_name}},
                      "claimRef": {"namespace": namespace, "name": FSX_CLAIM},
                  })
        k8s_object(self, "claim", api_version="v1", kind="PersistentVolumeClaim",
                  metadata=_metadata(FSX_CLAIM, namespace),
                  spec={"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv_name,
                        "resources": {"requests": {"storage": capacity}}})


__all__ = ["FSX_MOUNT", "EtcdChart", "PlatformCheckChart", "platform_check_name", "LustreVolumeValues", "NamespacesChart", "SchedulingChart", "StorageChart",
           "StorageClassChart"]
