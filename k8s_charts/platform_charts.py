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
from training.etcd_cluster import ETCD_MEMBERS, etcd_arguments

ETCD_NAME = "etcd"
# The headless Service that gives each member a stable DNS name (etcd-0.etcd-peers.<ns>.svc...).
ETCD_PEERS = "etcd-peers"
ETCD_METRICS_PORT = 2381  # /livez, /readyz and /metrics, plain HTTP, for the kubelet's probes
# A member on a node that stopped answering is marked for deletion after this long instead of
# Kubernetes' default 300 s. Its replacement still waits until the node object is gone (a
# StatefulSet never runs two pods of one identity), but the two others keep the quorum meanwhile.
ETCD_LOST_NODE_TOLERATION_SECONDS = 30
# Training pods run as this service account; the cluster gives it access to the data bucket's prefixes.
TRAINER_SERVICE_ACCOUNT = "trainer"
FSX_CLAIM = "fsx"
FSX_CSI_DRIVER = "fsx.csi.aws.com"
EBS_CSI_DRIVER = "ebs.csi.aws.com"
# A subdirectory of the member's volume: the volume's root holds ext4's lost+found.
ETCD_DATA_DIR = "/var/lib/etcd/data"
# The label the API server sets on every namespace (immutable): policies select namespaces by it.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def etcd_member_hosts(config: PlatformConfig) -> list[str]:
    namespace = config.jobs.platform_namespace
    return [f"{ETCD_NAME}-{i}.{ETCD_PEERS}.{namespace}.svc.cluster.local" for i in range(ETCD_MEMBERS)]


def etcd_endpoint(config: PlatformConfig) -> str:
    """torchrun's --rdzv-endpoint: every member's address. The rendezvous client moves to the next
    member the moment one stops answering, without waiting for a Service to drop it."""
    return ",".join(f"{host}:{ETCD_CLIENT_PORT}" for host in etcd_member_hosts(config))


def etcd_service_endpoint(config: PlatformConfig) -> str:
    """The client Service in front of the ready members (etcdctl, debugging)."""
    return f"{ETCD_NAME}.{config.jobs.platform_namespace}.svc.cluster.local:{ETCD_CLIENT_PORT}"


def system_node_selector() -> dict[str, str]:
    return {NODE_ROLE_LABEL: SYSTEM_ROLE}


def _metadata(name: str, namespace: str | None = None, **labels: str) -> dict:
    metadata = {"name": name, "labels": {"app.kubernetes.io/part-of": "training-platform", **labels}}
    if namespace:
        metadata["namespace"] = namespace
    return metadata


def pod_security_labels(enforce: str) -> dict[str, str]:
    """Pod Security Admission: ``enforce`` refuses pods above that level; warnings and audit
    entries report anything short of ``restricted``."""
    return {"pod-security.kubernetes.io/enforce": enforce, "pod-security.kubernetes.io/warn": "restricted",
            "pod-security.kubernetes.io/audit": "restricted"}


class NamespacesChart(Chart):
    """The platform's namespace (etcd), the jobs' namespace, its trainer service account, and who may reach its pods.

    Pod Security Admission levels: etcd's namespace is ``restricted``. The jobs' namespace is
    ``baseline``: its pods are restricted (non-root, no capability, RuntimeDefault seccomp)
    except two containers that run as root with CHOWN, DAC_OVERRIDE and FOWNER to work in the
    root-owned tree of the file system (k8s_charts/job_charts.py, writable_dirs_container and
    the data preparation); ``warn`` and ``audit`` name them.
    """

    def __init__(self, scope: Construct, id: str, config: PlatformConfig):
        super().__init__(scope, id)
        levels = {config.jobs.platform_namespace: "restricted", config.jobs.namespace: "baseline"}
        namespaces = {name: k8s_object(self, name, api_version="v1", kind="Namespace",
                                       metadata=_metadata(name, **pod_security_labels(level)))
                      for name, level in levels.items()}
        account = k8s_object(self, "trainer", api_version="v1", kind="ServiceAccount",
                             metadata=_metadata(TRAINER_SERVICE_ACCOUNT, config.jobs.namespace),
                             automountServiceAccountToken=False)
        account.add_dependency(namespaces[config.jobs.namespace])
        # Training pods take connections from pods of their own namespace only (the workers'
        # store on rank 0, NCCL's bootstrap and sockets). EFA traffic does not pass eth0.
        policy = k8s_object(self, "jobs-ingress", api_version="networking.k8s.io/v1", kind="NetworkPolicy",
                            metadata=_metadata("same-namespace-ingress", config.jobs.namespace),
                            spec={"podSelector": {}, "policyTypes": ["Ingress"],
                                  "ingress": [{"from": [{"podSelector": {}}]}]})
        policy.add_dependency(namespaces[config.jobs.namespace])


class EtcdChart(Chart):
    """Three etcd 3.5 members (v3 API, short Raft timing for 1 s leases): the rendezvous store of every job.

    A StatefulSet gives each member a stable name and its own encrypted gp3 volume. A member's
    identity is its data: one that came back empty under its old name could vote twice in a
    term, so etcd's rule is to remove and re-add a member that lost its data, which a volume
    makes unnecessary. The volume is tied to one AZ and detaches slowly from a dead node (up to
    6 minutes), but only the lost member waits for it: the two others keep the quorum, and jobs
    see no outage (tests/test_etcd_quorum.py: a member killed mid-run, no step lost, no
    re-rendezvous). Even a lost quorum is ridden out for 600 s (training/rendezvous.py).

    One member per system node (required anti-affinity), spread over AZs where it can be; a
    PodDisruptionBudget lets drains take one member at a time; cluster-autoscaler never removes
    a member's node to consolidate.
    """

    def __init__(self, scope: Construct, id: str, config: PlatformConfig):
        super().__init__(scope, id, namespace=config.jobs.platform_namespace)
        namespace = config.jobs.platform_namespace
        labels = {"app.kubernetes.io/name": ETCD_NAME}
        member_url = f"http://$(POD_NAME).{ETCD_PEERS}.{namespace}.svc.cluster.local"
        args = etcd_arguments(
            "$(POD_NAME)", ETCD_DATA_DIR,
            peers={f"{ETCD_NAME}-{i}": f"http://{host}:{ETCD_PEER_PORT}"
                   for i, host in enumerate(etcd_member_hosts(config))},
            listen_client_urls=[f"http://0.0.0.0:{ETCD_CLIENT_PORT}"],
            advertise_client_url=f"{member_url}:{ETCD_CLIENT_PORT}",
            listen_peer_url=f"http://$(POD_IP):{ETCD_PEER_PORT}",
            advertise_peer_url=f"{member_url}:{ETCD_PEER_PORT}",
            cluster_token=f"{config.name_prefix}-rendezvous",
            metrics_url=f"http://0.0.0.0:{ETCD_METRICS_PORT}")
        etcd = config.jobs.etcd

        def probe(path: str) -> dict:
            return {"httpGet": {"path": path, "port": ETCD_METRICS_PORT}, "periodSeconds": 5, "timeoutSeconds": 2}

        selector = {"matchLabels": labels}
        k8s_object(self, "statefulset", api_version="apps/v1", kind="StatefulSet",
                  metadata=_metadata(ETCD_NAME, namespace, **labels),
                  spec={
                      "replicas": ETCD_MEMBERS,
                      "serviceName": ETCD_PEERS,
                      # All members at once: a new cluster forms only when a quorum has started,
                      # which OrderedReady (each waits for the one before to be ready) never allows.
                      "podManagementPolicy": "Parallel",
                      "updateStrategy": {"type": "RollingUpdate"},
                      "selector": selector,
                      "template": {
                          "metadata": {"labels": {**labels, "app.kubernetes.io/part-of": "training-platform"},
                                       "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}},
                          "spec": {
                              "nodeSelector": system_node_selector(),
                              "priorityClassName": "system-cluster-critical",
                              "automountServiceAccountToken": False,
                              "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                                  {"labelSelector": selector, "topologyKey": "kubernetes.io/hostname"}]}},
                              "topologySpreadConstraints": [{
                                  "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                  "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": selector}],
                              "tolerations": [
                                  {"key": key, "operator": "Exists", "effect": "NoExecute",
                                   "tolerationSeconds": ETCD_LOST_NODE_TOLERATION_SECONDS}
                                  for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")],
                              "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                                  "fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
                              "containers": [{
                                  "name": ETCD_NAME,
                                  "image": config.versions.etcd_image,
                                  "command": ["etcd"],
                                  "args": args,
                                  "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                                          {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                                  "ports": [{"name": "client", "containerPort": ETCD_CLIENT_PORT},
                                            {"name": "peer", "containerPort": ETCD_PEER_PORT},
                                            {"name": "metrics", "containerPort": ETCD_METRICS_PORT}],
                                  # etcd 3.5.11+: /readyz needs a leader and a linearizable read; /livez
                                  # only that the member itself is not stuck.
                                  "readinessProbe": {**probe("/readyz"), "initialDelaySeconds": 2},
                                  "livenessProbe": {**probe("/livez"), "initialDelaySeconds": 15,
                                                    "failureThreshold": 6},
                                  "resources": {"requests": {"cpu": "250m", "memory": "256Mi"},
                                                "limits": {"memory": "1Gi"}},
                                  "securityContext": {"allowPrivilegeEscalation": False,
                                                      "readOnlyRootFilesystem": True,
                                                      "capabilities": {"drop": ["ALL"]}},
                                  "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
                              }],
                          },
                      },
                      "volumeClaimTemplates": [{
                          "metadata": {"name": "data", "labels": labels},
                          "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": etcd.storage_class,
                                   "resources": {"requests": {"storage": f"{etcd.persistent_volume_gib}Gi"}}},
                      }],
                  })
        k8s_object(self, "peers", api_version="v1", kind="Service",
                  metadata=_metadata(ETCD_PEERS, namespace, **labels),
                  spec={"clusterIP": "None", "selector": labels,
                        # Members must find each other before any is ready: readiness needs a quorum.
                        "publishNotReadyAddresses": True,
                        "ports": [{"name": "client", "port": ETCD_CLIENT_PORT, "targetPort": ETCD_CLIENT_PORT},
                                  {"name": "peer", "port": ETCD_PEER_PORT, "targetPort": ETCD_PEER_PORT}]})
        k8s_object(self, "service", api_version="v1", kind="Service",
                  metadata=_metadata(ETCD_NAME, namespace, **labels),
                  spec={"selector": labels,
                        "ports": [{"name": "client", "port": ETCD_CLIENT_PORT, "targetPort": ETCD_CLIENT_PORT}]})
        k8s_object(self, "budget", api_version="policy/v1", kind="PodDisruptionBudget",
                  metadata=_metadata(ETCD_NAME, namespace, **labels),
                  spec={"maxUnavailable": 1, "selector": selector})
        self._network_policies(config, labels)

    def _network_policies(self, config: PlatformConfig, labels: dict[str, str]) -> None:
        """Only the jobs' namespace reaches etcd's client port, only members its peer port; nothing else gets in.

        Enforced by the VPC CNI's network policy agent (enabled on the vpc-cni add-on,
        cdk_constructs/cluster_addons.py). It always admits traffic from the node itself, so the
        kubelet's probes on the metrics port pass.
        """
        namespace = config.jobs.platform_namespace
        k8s_object(self, "deny-ingress", api_version="networking.k8s.io/v1", kind="NetworkPolicy",
                  metadata=_metadata("deny-ingress", namespace),
                  spec={"podSelector": {}, "policyTypes": ["Ingress"]})
        k8s_object(self, "etcd-ingress", api_version="networking.k8s.io/v1", kind="NetworkPolicy",
                  metadata=_metadata(ETCD_NAME, namespace, **labels),
                  spec={"podSelector": {"matchLabels": labels}, "policyTypes": ["Ingress"], "ingress": [
                      {"from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: config.jobs.namespace}}}],
                       "ports": [{"protocol": "TCP", "port": ETCD_CLIENT_PORT}]},
                      {"from": [{"podSelector": {"matchLabels": labels}}],
                       "ports": [{"protocol": "TCP", "port": ETCD_CLIENT_PORT},
                                 {"protocol": "TCP", "port": ETCD_PEER_PORT}]},
                  ]})


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
        endpoint = f"http://{etcd_service_endpoint(config)}"
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
