"""Charts deployed with the platform: etcd for rendezvous, the Volcano queue and priority, the FSx volume."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cdk8s import Chart
from constructs import Construct

from config import PlatformConfig
from config.catalog import NODE_ROLE_LABEL, SYSTEM_ROLE
from k8s_charts.objects import checkov_skips, k8s_object
from k8s_charts.own_node import adds_taint, own_node_objects, own_node_policy
from k8s_charts.pods import MEMBER_POD_FIELDS, ONE_OFF_POD_FIELDS, SAFE_TO_EVICT, PodTemplate, lost_node_tolerations
from k8s_charts.volcano import VolcanoJob, VolcanoTask
from training.contract import (
    CLIENT_TLS_DIR, ETCD_CA_ENV, ETCD_CERT_ENV, ETCD_CLIENT_PORT, ETCD_KEY_ENV, ETCD_MEMBERS, ETCD_PEER_PORT,
    STRAGGLER_TAINT, MemberTLS, client_tls_environment, etcd_arguments,
)

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
STRAGGLER_TAINT_ACCESS = "training-platform-straggler-taint"  # the trainer's own-node role and policy
FSX_CLAIM = "fsx"
FSX_CSI_DRIVER = "fsx.csi.aws.com"
EBS_CSI_DRIVER = "ebs.csi.aws.com"
# A subdirectory of the member's volume: the volume's root holds ext4's lost+found.
ETCD_DATA_DIR = "/var/lib/etcd/data"
# The label the API server sets on every namespace (immutable): policies select namespaces by it.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
# TLS: cert-manager's Secrets (ca.crt, tls.crt, tls.key), mounted where etcd and the pods read them.
CERT_MANAGER_NAMESPACE = "cert-manager"
ETCD_CA_SECRET = "etcd-ca"  # in cert-manager's namespace, where a ClusterIssuer of type ca reads it
ETCD_SERVER_SECRET = "etcd-server-tls"
ETCD_PEER_SECRET = "etcd-peer-tls"
ETCD_CLIENT_SECRET = "etcd-client-tls"  # in the jobs' namespace
ETCD_TLS_DIR = "/etc/etcd/tls"
# Leaf certificates live 90 days and are renewed 30 days before they end. etcd reads its
# certificate files on every handshake and the rendezvous client on every new connection, so a
# renewal needs no restart. The CA lives 10 years: etcd reads its trust bundle once, at start.
LEAF_DURATION, LEAF_RENEW_BEFORE, CA_DURATION = "2160h", "720h", "87600h"


def etcd_member_hosts(config: PlatformConfig) -> list[str]:
    namespace = config.jobs.platform_namespace
    return [f"{ETCD_NAME}-{i}.{ETCD_PEERS}.{namespace}.svc.cluster.local" for i in range(ETCD_MEMBERS)]


def etcd_endpoint(config: PlatformConfig) -> str:
    """torchrun's --rdzv-endpoint: every member's address, over TLS. The rendezvous client moves to
    the next member the moment one stops answering, without waiting for a Service to drop it."""
    return ",".join(f"https://{host}:{ETCD_CLIENT_PORT}" for host in etcd_member_hosts(config))


def etcd_service_endpoint(config: PlatformConfig) -> str:
    """The client Service in front of the ready members (etcdctl, debugging)."""
    return f"https://{ETCD_NAME}.{config.jobs.platform_namespace}.svc.cluster.local:{ETCD_CLIENT_PORT}"


def client_tls_volume() -> tuple[dict, dict]:
    """(volume, mount) of the jobs' client certificate, for any pod of the jobs' namespace that talks to etcd."""
    return ({"name": "etcd-tls", "secret": {"secretName": ETCD_CLIENT_SECRET, "defaultMode": 0o444}},
            {"name": "etcd-tls", "mountPath": CLIENT_TLS_DIR, "readOnly": True})


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
        # A job replacing a straggler (its spec's straggler_policy) taints the straggler's node from that
        # node's own pod, and may change nothing else of any node.
        username = f"system:serviceaccount:{config.jobs.namespace}:{TRAINER_SERVICE_ACCOUNT}"
        own_node_objects(self, STRAGGLER_TAINT_ACCESS, _metadata(STRAGGLER_TAINT_ACCESS)["labels"], [
            {"kind": "ServiceAccount", "name": TRAINER_SERVICE_ACCOUNT, "namespace": config.jobs.namespace}],
            own_node_policy(STRAGGLER_TAINT_ACCESS, "a training pod", username,
                            taints=adds_taint(STRAGGLER_TAINT, "NoSchedule")))
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
    see no outage (tests/drills/test_etcd_quorum.py: a member killed mid-run, no step lost, no
    re-rendezvous). Even a lost quorum is ridden out for 600 s (training/launcher/rendezvous.py).

    One member per system node (required anti-affinity), spread over AZs where it can be; a
    PodDisruptionBudget lets drains take one member at a time; cluster-autoscaler never removes
    a member's node to consolidate.
    """

    def __init__(self, scope: Construct, id: str, config: PlatformConfig):
        super().__init__(scope, id, namespace=config.jobs.platform_namespace)
        namespace = config.jobs.platform_namespace
        labels = {"app.kubernetes.io/name": ETCD_NAME}
        member_url = f"https://$(POD_NAME).{ETCD_PEERS}.{namespace}.svc.cluster.local"
        # Clients and peers both present a certificate of the platform's CA (EtcdCertificatesChart).
        tls = MemberTLS(ca_file=f"{ETCD_TLS_DIR}/server/ca.crt",
                        cert_file=f"{ETCD_TLS_DIR}/server/tls.crt", key_file=f"{ETCD_TLS_DIR}/server/tls.key",
                        peer_cert_file=f"{ETCD_TLS_DIR}/peer/tls.crt", peer_key_file=f"{ETCD_TLS_DIR}/peer/tls.key")
        args = etcd_arguments(
            "$(POD_NAME)", ETCD_DATA_DIR,
            peers={f"{ETCD_NAME}-{i}": f"https://{host}:{ETCD_PEER_PORT}"
                   for i, host in enumerate(etcd_member_hosts(config))},
            listen_client_urls=[f"https://0.0.0.0:{ETCD_CLIENT_PORT}"],
            advertise_client_url=f"{member_url}:{ETCD_CLIENT_PORT}",
            listen_peer_url=f"https://$(POD_IP):{ETCD_PEER_PORT}",
            advertise_peer_url=f"{member_url}:{ETCD_PEER_PORT}",
            cluster_token=f"{config.name_prefix}-rendezvous", tls=tls,
            # Plain HTTP, without client certificates: the kubelet's probes (/livez, /readyz).
            metrics_url=f"http://0.0.0.0:{ETCD_METRICS_PORT}")
        etcd = config.jobs.etcd

        def probe(path: str) -> dict:
            return {"httpGet": {"path": path, "port": ETCD_METRICS_PORT}, "periodSeconds": 5, "timeoutSeconds": 2}

        selector = {"matchLabels": labels}
        skips = {
            "CKV_K8S_43": "the etcd image is pinned by tag in the config (versions.etcd_image accepts a digest)",
            "CKV_K8S_15": "the image is pinned; pulling Always would make a member's restart depend on the registry",
            "CKV_K8S_11": "no CPU limit: a throttled member misses Raft heartbeats and loses its leadership",
        }
        container = {
            "name": ETCD_NAME,
            "image": config.versions.etcd_image,
            # The flags in the command, not args: that is where scanners (checkov's CIS etcd checks)
            # look for the TLS flags.
            "command": ["etcd", *args],
            "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "ports": [{"name": "client", "containerPort": ETCD_CLIENT_PORT},
                      {"name": "peer", "containerPort": ETCD_PEER_PORT},
                      {"name": "metrics", "containerPort": ETCD_METRICS_PORT}],
            # etcd 3.5.11+: /readyz needs a leader and a linearizable read; /livez only that the
            # member itself is not stuck.
            "readinessProbe": {**probe("/readyz"), "initialDelaySeconds": 2},
            "livenessProbe": {**probe("/livez"), "initialDelaySeconds": 15, "failureThreshold": 6},
            "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]}},
            "volumeMounts": [
                {"name": "data", "mountPath": "/var/lib/etcd"},
                {"name": "server-tls", "mountPath": f"{ETCD_TLS_DIR}/server", "readOnly": True},
                {"name": "peer-tls", "mountPath": f"{ETCD_TLS_DIR}/peer", "readOnly": True}],
        }
        pod = PodTemplate(
            labels={**labels, "app.kubernetes.io/part-of": "training-platform"},
            annotations=dict(SAFE_TO_EVICT),
            node_selector=system_node_selector(),
            priority_class_name="system-cluster-critical",
            affinity={"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": selector, "topologyKey": "kubernetes.io/hostname"}]}},
            topology_spread_constraints=[{
                "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": selector}],
            tolerations=lost_node_tolerations(ETCD_LOST_NODE_TOLERATION_SECONDS),
            security_context={"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
                              "seccompProfile": {"type": "RuntimeDefault"}},
            containers=[container],
            # Secret volumes, not subPath mounts: the kubelet swaps renewed files in.
            volumes=[
                {"name": "server-tls", "secret": {"secretName": ETCD_SERVER_SECRET, "defaultMode": 0o440}},
                {"name": "peer-tls", "secret": {"secretName": ETCD_PEER_SECRET, "defaultMode": 0o440}}],
            fields=MEMBER_POD_FIELDS,
        )
        k8s_object(self, "statefulset", api_version="apps/v1", kind="StatefulSet",
                  metadata={**_metadata(ETCD_NAME, namespace, **labels), "annotations": checkov_skips(skips)},
                  spec={
                      "replicas": ETCD_MEMBERS,
                      "serviceName": ETCD_PEERS,
                      # All members at once: a new cluster forms only when a quorum has started,
                      # which OrderedReady (each waits for the one before to be ready) never allows.
                      "podManagementPolicy": "Parallel",
                      # Rendezvous state only: the volumes go with the StatefulSet (a teardown leaves
                      # none behind), and stay when it is scaled.
                      "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
                      "updateStrategy": {"type": "RollingUpdate"},
                      "selector": selector,
                      "template": pod.to_dict(),
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


def _certificate(scope: Construct, id: str, name: str, namespace: str, issuer: str, spec: dict) -> None:
    k8s_object(scope, id, api_version="cert-manager.io/v1", kind="Certificate",
               metadata=_metadata(name, namespace),
               spec={"secretName": spec.pop("secretName"), "issuerRef": {"name": issuer, "kind": "ClusterIssuer",
                                                                       "group": "cert-manager.io"},
                     "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"}, **spec})


class EtcdCertificatesChart(Chart):
    """The certificates of etcd's members and of the jobs, issued and renewed by cert-manager.

    A self-signed ClusterIssuer makes the platform's CA; its key stays in cert-manager's own
    namespace, where the CA ClusterIssuer reads it. From that CA: one certificate the members
    present to clients, one they present to each other (both with the clientAuth usage too: etcd's
    JSON gateway dials its own member with the server certificate, and peers authenticate each
    other), and one client certificate in the jobs' namespace, which every training pod mounts.
    No key or certificate is in a template: cert-manager creates the Secrets in the cluster and
    renews them (LEAF_RENEW_BEFORE), and both etcd and the rendezvous client pick renewed files
    up without a restart.
    """

    def __init__(self, scope: Construct, id: str, config: PlatformConfig):
        super().__init__(scope, id)
        prefix, namespace = config.name_prefix, config.jobs.platform_namespace
        bootstrap, authority = f"{prefix}-etcd-selfsigned", f"{prefix}-etcd-ca"
        k8s_object(self, "selfsigned", api_version="cert-manager.io/v1", kind="ClusterIssuer",
                   metadata=_metadata(bootstrap), spec={"selfSigned": {}})
        _certificate(self, "ca", ETCD_CA_SECRET, CERT_MANAGER_NAMESPACE, bootstrap, {
            "secretName": ETCD_CA_SECRET, "isCA": True, "commonName": f"{prefix} etcd CA",
            "duration": CA_DURATION})
        k8s_object(self, "authority", api_version="cert-manager.io/v1", kind="ClusterIssuer",
                   metadata=_metadata(authority), spec={"ca": {"secretName": ETCD_CA_SECRET}})
        members = etcd_member_hosts(config)
        service = [ETCD_NAME, f"{ETCD_NAME}.{namespace}", f"{ETCD_NAME}.{namespace}.svc",
                   f"{ETCD_NAME}.{namespace}.svc.cluster.local"]
        leaf = {"duration": LEAF_DURATION, "renewBefore": LEAF_RENEW_BEFORE}
        _certificate(self, "server", "etcd-server", namespace, authority, {
            "secretName": ETCD_SERVER_SECRET, "commonName": ETCD_NAME, "dnsNames": [*service, *members, "localhost"],
            "ipAddresses": ["127.0.0.1"], "usages": ["digital signature", "server auth", "client auth"], **leaf})
        # Each member checks that a peer's certificate names the address it connects from: every
        # member's stable name, which the headless Service resolves to its pod's IP.
        _certificate(self, "peer", "etcd-peer", namespace, authority, {
            "secretName": ETCD_PEER_SECRET, "commonName": "etcd-peer", "dnsNames": members,
            "usages": ["digital signature", "server auth", "client auth"], **leaf})
        _certificate(self, "client", "etcd-client", config.jobs.namespace, authority, {
            "secretName": ETCD_CLIENT_SECRET, "commonName": f"{config.jobs.namespace}-jobs",
            "usages": ["digital signature", "client auth"], **leaf})


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
    # Not the pipeline section: a stage deploys the same platform as a direct deploy. Nor unset optional
    # sections: a release that adds one (batch, slurm) leaves the name of an unchanged config alone.
    digest = hashlib.sha256(config.model_dump_json(exclude={"pipeline"}, exclude_none=True).encode()).hexdigest()[:10]
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
        endpoint = etcd_service_endpoint(config)
        tls_volume, tls_mount = client_tls_volume()
        tls = client_tls_environment()
        pod = PodTemplate(
            restart_policy="Never",
            node_selector=system_node_selector(),
            security_context={"runAsNonRoot": True, "runAsUser": 65532,
                              "seccompProfile": {"type": "RuntimeDefault"}},
            containers=[{
                "name": "etcd-health",
                "image": config.versions.etcd_image,
                "command": ["etcdctl", f"--endpoints={endpoint}", "--command-timeout=10s",
                            f"--cacert={tls[ETCD_CA_ENV]}", f"--cert={tls[ETCD_CERT_ENV]}",
                            f"--key={tls[ETCD_KEY_ENV]}", "endpoint", "health"],
                "volumeMounts": [tls_mount],
                "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
            volumes=[tls_volume],
            fields=ONE_OFF_POD_FIELDS,
        )
        job = VolcanoJob(queue=config.jobs.queue.name, priority_class=config.jobs.priority_class.name,
                         min_available=1, max_retry=3, ttl_seconds_after_finished=3600,
                         tasks=[VolcanoTask("check", replicas=1, template=pod)])
        job.add_to(self, "job", metadata=_metadata(platform_check_name(config), config.jobs.namespace))


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


__all__ = ["EtcdCertificatesChart", "EtcdChart", "PlatformCheckChart", "platform_check_name", "LustreVolumeValues",
           "NamespacesChart", "SchedulingChart", "StorageChart", "StorageClassChart"]
