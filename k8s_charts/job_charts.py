"""Charts rendered per job: the elastic training job, the EFA/NCCL check, and data preparation."""

from __future__ import annotations

from dataclasses import replace

from cdk8s import Chart
from constructs import Construct

from config import AcceleratedNodeGroupConfig, PlatformConfig
from config.catalog import INSTANCE_TYPE_LABEL, NODE_ROLE_LABEL, SYSTEM_ROLE, Accelerator
from config.node_groups import CapacityType
from config.job_spec import JobSpec
from k8s_charts.objects import checkov_skips, k8s_object
from k8s_charts.platform_charts import (
    FSX_CLAIM, TRAINER_SERVICE_ACCOUNT, client_tls_volume, etcd_endpoint,
)
from k8s_charts.pods import (
    ONE_OFF_POD_FIELDS, SAFE_TO_EVICT, TRAINING_POD_FIELDS, PodTemplate, Toleration, lost_node_tolerations,
)
from k8s_charts.volcano import (
    Action, Event, LifecyclePolicy, NetworkTopology, TopologyMode, VolcanoJob, VolcanoTask,
)
from training.contract import (
    DATASETS_DIR, FSX_MOUNT, EXIT_CONFIG, EXIT_CRASH_LOOP, EXIT_DIVERGED, EXIT_RESTART_JOB, EXIT_STOPPED, LAUNCH_ENVIRONMENT,
    LAUNCHER_ENTRY, LAUNCHER_MOUNT, PLATFORM_APP_DIR, PLATFORM_TUNING, SPOT_NOTICE_ENV, TRAINER_MODULE, cache_dir,
    client_tls_environment, launch_command, launcher_copy_command, INSTANCE_TYPE_ENV, NODE_LABELS_FILE_ENV,
    NODE_LABELS_MODULE, NODE_NAME_ENV, POD_NAME_ENV,
)

# Kept free on every node for the kubelet, the OS and the platform's DaemonSets.
RESERVED_VCPUS = 4
RESERVED_MEMORY_FRACTION = 0.10
SHM_FRACTION = 0.25  # /dev/shm (DataLoader workers pass batches through it), of the pod's memory
# SIGTERM to the pod -> the agent -> workers checkpoint; the agent gives them this much less its
# margin (training.launcher.main.shutdown_timeout) before SIGKILL.
TERMINATION_GRACE_SECONDS = 120
# A pod on a node that stopped answering is deleted (and replaced) after this long instead of
# Kubernetes' default 300 s; the survivors have gone on without it within seconds anyway.
LOST_NODE_TOLERATION_SECONDS = 60
# The pod annotations Volcano's job controller writes (pkg/controllers/job/job_controller_util.go
# createJobPod, v1.15.1): the PodGroup name (<job>-<uid>) and the job version, which only a
# whole-job restart bumps (job_controller_actions.go killPods).
GROUP_NAME_ANNOTATION = "scheduling.k8s.io/group-name"
JOB_VERSION_ANNOTATION = "volcano.sh/job-version"


# Volcano's RetryCount only grows: every RestartPod and RestartJob adds one, nothing resets it,
# and the job fails once it reaches maxRetry (pkg/controllers/job/state/running.go 35-46,
# state/restarting.go 35-39, v1.15.1). A long job on Spot capacity that makes progress must not end
# on a count of pods lost, so the count is set out of reach: the largest value the CRD's int32
# field holds. Crash loops are bounded where progress is known: the agent's progress-aware
# --max-restarts, then EXIT_CRASH_LOOP (training/contract.py, training/launcher/main.py).
VOLCANO_MAX_RETRY = 2**31 - 1
# The trainer images' user (training/docker/Dockerfile.*): the pods run as it, never as root.
# Above 10000, so it matches no user of the node's own.
TRAINER_UID = 10001


# checkov findings the training and NCCL-check pods accept, each for its reason (tests/drills/test_checkov.py).
PINNED_IMAGE_SKIPS = {
    "CKV_K8S_43": "images are pinned by tag or by digest (the job spec accepts both); a digest is not required",
    "CKV_K8S_15": "images are pinned; pulling Always would make every pod restart depend on the registry",
}
WORKER_SKIPS = {
    **PINNED_IMAGE_SKIPS,
    "CKV_K8S_11": "no CPU limit: CFS quotas throttle the data loaders; the request reserves the pod's share of "
                  "the node",
    "CKV_K8S_8": "a batch worker serves nothing to probe: the agent and the rendezvous notice a dead or hung worker",
    "CKV_K8S_9": "a batch worker serves nothing to probe: the agent and the rendezvous notice a dead or hung worker",
    "CKV_K8S_22": "torch, Triton, NCCL and the Neuron runtime write temporary files and caches under the image's "
                  "paths",
}
# checkov reads a batch Job's pod at spec.template; a Volcano Job keeps its pods at
# spec.tasks[].template, so these pod checks fail on a path that does not exist. The pods pass
# them: tests/drills/test_checkov.py scans each task's pod as a Pod, without these skips.
VOLCANO_LAYOUT_SKIPS = {check: "checkov looks for the pod at spec.template; a Volcano Job keeps it at "
                               "spec.tasks[].template, where it passes this check (tests/drills/test_checkov.py)"
                        for check in ("CKV_K8S_23", "CKV_K8S_29", "CKV_K8S_31", "CKV_K8S_38", "CKV_K8S_40")}
WRITABLE_DIRS_SKIPS = {
    "CKV_K8S_25": "only the writable-dirs init container adds CHOWN, DAC_OVERRIDE and FOWNER, to hand the job's "
                  "root-owned directories on FSx to the trainer user",
}


def job_policies() -> list[LifecyclePolicy]:
    """What Volcano v1.15.1's job controller does when a pod of the job ends (pkg/controllers/job).

    The controller takes the first policy in list order whose event or exit code matches
    (job_controller_util.go applyPolicies); exit codes are the first container's.
    - the trainer's config, data or checkpoint directory is wrong, its loss diverged, or its
      workers crash in a loop with no checkpoint since the agent started: terminate, nothing
      would fix it by retrying;
    - the agent's workers failed for good after progress: restart the whole job, which bumps the
      job version and so gives the next incarnation a fresh rendezvous id;
    - the agent was stopped by the pod's SIGTERM (a drain, a Spot reclaim): nothing. The pod is
      being deleted; its deletion (PodEvicted, no policy) makes the controller's sync recreate
      it (job_controller_actions.go syncJob) without a retry counted and without RestartPod's
      side effects: RestartPod deletes the job's PodGroup and runs every plugin's delete hook
      (killPods). ResumeJob is the user-allowed action that is a plain sync in the Running
      state (state/running.go default branch);
    - any other failure of a pod: replace that pod alone (RestartPod deletes only it); the
      survivors go on at N-1 through the rendezvous, and the replacement joins them. A straggler's
      pod that left because its node is replaced (EXIT_REPLACE_NODE) takes this path too: its
      node is tainted, so the new pod lands on another (a fresh one cluster-autoscaler brings).
    """
    return [
        LifecyclePolicy(Action.TERMINATE_JOB, exit_code=EXIT_CONFIG),
        LifecyclePolicy(Action.TERMINATE_JOB, exit_code=EXIT_DIVERGED),
        LifecyclePolicy(Action.TERMINATE_JOB, exit_code=EXIT_CRASH_LOOP),
        LifecyclePolicy(Action.RESTART_JOB, exit_code=EXIT_RESTART_JOB),
        LifecyclePolicy(Action.RESUME_JOB, exit_code=EXIT_STOPPED),
        LifecyclePolicy(Action.RESTART_POD, events=[Event.POD_FAILED]),
    ]


def nccl_check_policies() -> list[LifecyclePolicy]:
    """The NCCL check runs once: any failed or deleted pod ends it, and no retry is left to take."""
    return [LifecyclePolicy(Action.TERMINATE_JOB, events=[Event.POD_FAILED, Event.POD_EVICTED])]


def restricted_pod_security(uid: int = TRAINER_UID) -> tuple[dict, dict]:
    """(pod, container) security contexts the Pod Security Standards' restricted level asks for."""
    pod = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return pod, container


def nccl_environment(efa: bool, rdma: bool) -> dict[str, str]:
    """NCCL over EFA (docs/DESIGN.md, "NCCL over EFA"); without EFA only the interface and error settings apply."""
    env = {
        "NCCL_SOCKET_IFNAME": "^lo,docker,pod-id-link",
        # A failed or timed-out collective aborts the communicator and ends the worker, so its
        # agent restarts the group instead of waiting forever (torch ProcessGroupNCCL watchdog).
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "120",
    }
    if efa:
        # Fork-safe: DataLoader workers and the launcher's workers are forked. Huge pages off: the
        # EFA provider uses none when fork-safe (libfabric man/fi_efa.7.md, v1.22.0 to v2.6.0), so the
        # pod requests no hugepages-2Mi, which nodes of a group at zero could not advertise to
        # cluster-autoscaler anyway. Said explicitly, so it never depends on that default.
        env.update(FI_PROVIDER="efa", FI_EFA_FORK_SAFE="1", FI_EFA_USE_HUGE_PAGE="0")
        if rdma:
            env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return env


def pod_resources(spec: JobSpec, config: PlatformConfig) -> dict:
    """Accelerators and EFA devices from the catalog; CPU and memory in proportion, minus headroom."""
    instance = spec.group(config).instance
    share = spec.accelerators(config) / instance.accelerator_count
    cpus = max(1, int((instance.vcpus - RESERVED_VCPUS) * share))
    memory = max(1, int(instance.memory_gib * (1 - RESERVED_MEMORY_FRACTION) * share))
    devices = {instance.accelerator_resource: spec.accelerators(config)}
    if spec.efa_devices(config):
        devices[instance.efa_resource] = spec.efa_devices(config)
    requests = {"cpu": str(cpus), "memory": f"{memory}Gi", **{k: v for k, v in devices.items()}}
    return {"requests": requests, "limits": {"memory": f"{memory}Gi", **devices}}


def _env(values: dict[str, str]) -> list[dict]:
    return [{"name": k, "value": str(v)} for k, v in sorted(values.items())]


def spot_environment(group: AcceleratedNodeGroupConfig) -> dict[str, str]:
    """On Spot nodes the trainer watches the node's metadata for the two-minute interruption notice
    and checkpoints before the drain's SIGTERM (the launch template's hop limit 2 lets pods reach it)."""
    return {SPOT_NOTICE_ENV: "imds"} if group.capacity_type is CapacityType.SPOT else {}


def cache_environment(spec: JobSpec, config: PlatformConfig) -> dict[str, str]:
    """Compiler caches on the shared file system, per job: a restart or a new world size does not
    compile again what an earlier incarnation compiled (torch.compile's Inductor and Triton caches;
    the Neuron compiler's cache). Not under the S3-linked directories: caches stay on FSx."""
    cache = cache_dir(spec.name)
    if spec.group(config).instance.accelerator is Accelerator.NEURON:
        # As AWS's Neuron samples on EKS do: the compile cache and the collectives' socket interface.
        return {"NEURON_CC_FLAGS": f"--cache_dir={cache}/neuron", "CCOM_SOCKET_IFNAME": "eth0"}
    return {"TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton"}


def _shared_volumes(memory_gib: int) -> tuple[list[dict], list[dict]]:
    volumes = [
        {"name": "fsx", "persistentVolumeClaim": {"claimName": FSX_CLAIM}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{max(1, int(memory_gib * SHM_FRACTION))}Gi"}},
    ]
    mounts = [{"name": "fsx", "mountPath": FSX_MOUNT}, {"name": "shm", "mountPath": "/dev/shm"}]
    return volumes, mounts


def _downward_env() -> list[dict]:
    return [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # Where each rank runs, named in the trainer's straggler events (training/loop/stragglers.py).
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        # Volcano names a job's PodGroup <job>-<uid>: unique for every submission. With the job
        # version it is unique for every incarnation: a pod replaced alone keeps both and joins
        # the running round; a whole-job restart gets a fresh, open one.
        {"name": "PODGROUP", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{GROUP_NAME_ANNOTATION}']"}}},
        {"name": "JOB_VERSION", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{JOB_VERSION_ANNOTATION}']"}}},
    ]


RDZV_ID = "$(PODGROUP)-v$(JOB_VERSION)"  # the kubelet expands both from the container's env


def pod_command(spec: JobSpec, config: PlatformConfig, program: list[str]) -> list[str]:
    """The launcher's command for this job (training.contract.launch_command) running ``program``; a
    job's own program runs under the launcher injected into its image (:func:`launcher_container`)."""
    return launch_command(
        min_nodes=spec.min_nodes, max_nodes=spec.max_nodes, nproc_per_node=spec.nproc_per_node(config),
        endpoint=etcd_endpoint(config), run_id=RDZV_ID, max_restarts=spec.max_restarts, local_addr="$(POD_IP)",
        grace_period_s=TERMINATION_GRACE_SECONDS,
        tuning=replace(PLATFORM_TUNING, scale_up_after_s=spec.scale_up_after_s),
        program=program, launcher=LAUNCHER_ENTRY if spec.program is not None else None,
    )


# The launcher's volume: a few hundred KB of Python files.
LAUNCHER_VOLUME = {"name": "platform-launcher", "emptyDir": {"sizeLimit": "64Mi"}}


def launcher_container(image: str) -> dict:
    """An init container that copies the platform's launcher (training.contract.LAUNCHER_PACKAGE)
    from the platform's image into the pod's launcher volume, for a job whose image lacks it.

    Why an init container: the user's image stays as built (no rebuild, no layer of ours), the
    launcher is the one of the platform's image the config names (it speaks this platform's
    rendezvous), and the copy is per pod, so nothing is shared or left behind on a node or on FSx.
    It runs as the pods' user with no capability, like the trainer; the trainer mounts the volume
    read-only.
    """
    return {
        "name": "platform-launcher",
        "image": image,
        "command": launcher_copy_command(LAUNCHER_MOUNT),
        "workingDir": PLATFORM_APP_DIR,
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "64Mi"}},
        "volumeMounts": [{"name": LAUNCHER_VOLUME["name"], "mountPath": LAUNCHER_MOUNT}],
        "securityContext": restricted_pod_security()[1],
    }


# Where the node-labels init container leaves its file for the agent (contract.NODE_LABELS_FILE_ENV).
NODE_INFO_VOLUME = {"name": "node-info", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}
NODE_INFO_MOUNT = "/platform-node"
NODE_LABELS_FILE = f"{NODE_INFO_MOUNT}/labels.json"
# The token of that container alone: projected, as the kubelet's own kube-api-access volume is made
# (the token, the cluster's CA, the namespace), at the path the Kubernetes client reads in a pod.
NODE_LABELS_TOKEN_VOLUME = {"name": "node-labels-token", "projected": {"sources": [
    {"serviceAccountToken": {"path": "token", "expirationSeconds": 600}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
]}}
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def node_labels_container(image: str) -> dict:
    """An init container that writes its node's network labels for the agent (training/node_labels.py), so
    that the round's ranks follow the network (training/launcher/topology.py).

    Why: the downward API cannot pass a node's labels (KEP-4742's PodTopologyLabelsAdmission copies only
    the zone and region), so something reads the Node. This container alone mounts a token, and the
    trainer's account may get Nodes (NamespacesChart's own-node role) and change only its own node's
    straggler taint; the trainer, which may run the user's program, gets no token (unless it replaces
    stragglers). It runs as the pods' user with no capability, and never fails the pod.
    """
    return {
        "name": "node-labels",
        "image": image,
        "command": ["python", "-m", NODE_LABELS_MODULE, NODE_LABELS_FILE],
        "workingDir": PLATFORM_APP_DIR,
        "env": [{"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "256Mi"}},
        "volumeMounts": [{"name": NODE_INFO_VOLUME["name"], "mountPath": NODE_INFO_MOUNT},
                         {"name": NODE_LABELS_TOKEN_VOLUME["name"], "mountPath": SERVICE_ACCOUNT_DIR,
                          "readOnly": True}],
        "securityContext": restricted_pod_security()[1],
    }


class _VolcanoJobChart(Chart):
    """A Volcano Job of min..max identical pods, one per node, running torchrun."""

    def __init__(self, scope: Construct, id: str, config: PlatformConfig, spec: JobSpec, name: str,
                 program: list[str], policies: list[LifecyclePolicy], max_retry: int, writable_dirs: list[str] = (),
                 extra_env: dict[str, str] | None = None):
        super().__init__(scope, id)
        group = spec.group(config)
        instance = group.instance
        resources = pod_resources(spec, config)
        memory_gib = int(resources["requests"]["memory"].removesuffix("Gi"))
        volumes, mounts = _shared_volumes(memory_gib)
        tls_volume, tls_mount = client_tls_volume()  # the rendezvous is mutual TLS
        efa = spec.efa_devices(config) > 0
        env = {**nccl_environment(efa, rdma=instance.efa_rdma),
               **cache_environment(spec, config), **LAUNCH_ENVIRONMENT, **client_tls_environment(),
               "OMP_NUM_THREADS": "1", INSTANCE_TYPE_ENV: instance.name,
               **spot_environment(group), **spec.program_environment(), **(extra_env or {}), **spec.env}
        labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "training-platform"}
        pod_security, container_security = restricted_pod_security()
        # A job's own program runs in its own image: the platform's image (config.jobs.launcher_image)
        # brings the launcher, and sets up the job's directories, which the user's image may lack the tools for.
        own_program = spec.program is not None
        platform_image = config.jobs.launcher_image if own_program else spec.image
        launcher_mounts = [{"name": LAUNCHER_VOLUME["name"], "mountPath": LAUNCHER_MOUNT, "readOnly": True}
                           ] if own_program else []
        # Ranks in network order where EKS labels the nodes with their network (the catalog's types with one).
        network_order = instance.network_layers > 0
        node_info_mounts = [{"name": NODE_INFO_VOLUME["name"], "mountPath": NODE_INFO_MOUNT, "readOnly": True}
                            ] if network_order else []
        if network_order:
            env[NODE_LABELS_FILE_ENV] = NODE_LABELS_FILE
        container = {
            "name": "trainer",
            "image": spec.image,
            # The kubelet expands $(POD_IP), $(PODGROUP) and $(JOB_VERSION) from the env; no shell.
            "command": pod_command(spec, config, program),
            "env": _downward_env() + _env(env),
            "resources": resources,
            "volumeMounts": [*mounts, tls_mount, *launcher_mounts, *node_info_mounts],
            # No capability: EFA, NVIDIA and Neuron device files are opened through the device
            # plugins' cgroup grants, and EFA's pinned memory is bounded by the node's memlock
            # limit, not by CAP_IPC_LOCK (the same holds for root in a container, which has no
            # IPC_LOCK either).
            "securityContext": container_security,
        }
        init_containers = [writable_dirs_container(platform_image, writable_dirs, mounts)] if writable_dirs else []
        if own_program:
            init_containers.append(launcher_container(platform_image))
        if network_order:
            init_containers.append(node_labels_container(platform_image))
        skips = {**WORKER_SKIPS, **(WRITABLE_DIRS_SKIPS if writable_dirs else {}), **VOLCANO_LAYOUT_SKIPS}
        pod = PodTemplate(
            labels=labels, annotations=dict(SAFE_TO_EVICT),
            restart_policy="Never",
            service_account=TRAINER_SERVICE_ACCOUNT,
            # Replacing a straggler's node: the trainer taints its own node through the API (the token's
            # node-name holds it to that: NamespacesChart's own-node policy). No other pod gets a token.
            automount_service_account_token=spec.straggler_policy == "replace",
            security_context=pod_security,
            termination_grace_period_seconds=TERMINATION_GRACE_SECONDS,
            node_selector={INSTANCE_TYPE_LABEL: instance.name},
            tolerations=[Toleration(instance.taint_key), *lost_node_tolerations(LOST_NODE_TOLERATION_SECONDS)],
            init_containers=init_containers,
            containers=[container],
            volumes=[*volumes, tls_volume, *([LAUNCHER_VOLUME] if own_program else []),
                     *([NODE_INFO_VOLUME, NODE_LABELS_TOKEN_VOLUME] if network_order else [])],
            fields=TRAINING_POD_FIELDS,
        )
        job = VolcanoJob(
            queue=spec.queue or config.jobs.queue.name,
            priority_class=spec.priority_class or config.jobs.priority_class.name,
            min_available=spec.min_nodes,
            # Training ended as soon as one pod succeeds: every agent of the final round exits
            # 0 after the final checkpoint, and pods still waiting for a node must not keep
            # the job Running (pkg/controllers/job/state/running.go, v1.15.1).
            min_success=1,
            max_retry=max_retry,
            ttl_seconds_after_finished=config.jobs.ttl_seconds_after_finished,
            # No plugins: the rendezvous is etcd's, so nothing needs svc's hostnames or env's
            # VC_TASK_INDEX, and every RestartPod would delete and recreate svc's ConfigMap,
            # Service and NetworkPolicy (killPods runs each plugin's OnJobDelete,
            # job_controller_actions.go, v1.15.1): a pod starting meanwhile fails to mount them.
            policies=policies,
            tasks=[VolcanoTask("worker", replicas=spec.max_nodes, min_available=spec.min_nodes, template=pod)],
            # The job spec's tiers are Volcano's: the platform's HyperNode discovery makes tier N of the
            # network node N levels above the instances (k8s_charts/volcano.py topology_labels).
            network_topology=None if spec.network_topology.mode == "none" else NetworkTopology(
                TopologyMode(spec.network_topology.mode), spec.network_topology.tier),
        )
        job.add_to(self, "job", metadata={"name": name, "namespace": config.jobs.namespace, "labels": labels,
                                         "annotations": checkov_skips(skips)})


def writable_dirs_container(image: str, directories: list[str], mounts: list[dict]) -> dict:
    """An init container that makes the job's own directories on FSx the trainer user's.

    The file system's root and what its data repository imports from S3 belong to root, and
    the trainer runs as :data:`TRAINER_UID`: only this container runs as root, with the three
    capabilities that creating and handing over a directory in a root-owned tree needs (all
    within the Pod Security Standards' baseline level). It does not recurse: files of an earlier
    job stay whose they were.
    """
    return {
        "name": "writable-dirs",
        "image": image,
        "command": ["install", "-d", "-o", str(TRAINER_UID), "-g", str(TRAINER_UID), "-m", "0775", *directories],
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "64Mi"}},
        "volumeMounts": [m for m in mounts if m["mountPath"] == FSX_MOUNT],
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "DAC_OVERRIDE", "FOWNER"]}},
    }


class TrainingJobChart(_VolcanoJobChart):
    """The elastic training job: ``torchrun ... -m training train <the spec's trainer args>``, or the job's own program."""

    def __init__(self, scope: Construct, id: str, config: PlatformConfig, spec: JobSpec):
        super().__init__(scope, id, config, spec, spec.name, spec.program_arguments(config),
                         policies=job_policies(), max_retry=VOLCANO_MAX_RETRY,
                         writable_dirs=[spec.checkpoint_dir(), spec.staging_dir(), cache_dir(spec.name)])


class NcclCheckChart(_VolcanoJobChart):
    """An all-reduce bandwidth sweep over the job's nodes; fails if EFA was wanted and NCCL is not on it.

    GPU groups only: on Trainium, collectives run through the Neuron runtime, which
    ``allreduce-bench`` (NCCL or gloo) does not drive, so no check is rendered there.
    """

    def __init__(self, scope: Construct, id: str, config: PlatformConfig, spec: JobSpec):
        sweep = ["allreduce-bench", "--max-bytes=2147483648"]
        if spec.efa_devices(config):
            sweep.append("--require-efa")
        # A job with its own program is checked with the platform's image (its launcher image), which has the sweep.
        image = config.jobs.launcher_image if spec.program is not None else spec.image
        check = spec.model_copy(update={"name": f"{spec.name}-nccl", "min_nodes": spec.max_nodes, "max_restarts": 0,
                                        "program": None, "image": image})
        # maxRetry 1, not 0: Volcano's mutating webhook turns 0 into 3 (mutate_job.go
        # patchDefaultMaxRetry, v1.15.1). With the policies no restart is ever asked for anyway.
        super().__init__(scope, id, config, check, check.name, ["-m", TRAINER_MODULE, *sweep],
                         policies=nccl_check_policies(), max_retry=1)


class DataPrepChart(Chart):
    """Checks the imported ImageNet copy on FSx, rearranges val/ into class folders, writes a manifest."""

    def __init__(self, scope: Construct, id: str, config: PlatformConfig, image: str,
                 dataset_path: str = f"{DATASETS_DIR}/imagenet", labels_file: str = "LOC_val_solution.csv"):
        super().__init__(scope, id)
        volumes, mounts = _shared_volumes(memory_gib=4)
        root = ("it rearranges files the data repository imported as root's: root with CHOWN, DAC_OVERRIDE and "
                "FOWNER only, every other capability dropped")
        skips = {**PINNED_IMAGE_SKIPS, "CKV_K8S_23": root, "CKV_K8S_40": root, "CKV_K8S_25": root,
                 "CKV_K8S_11": "no CPU limit: a one-off job on a system node, bounded by its memory limit and "
                               "its request"}
        # Root, because it rearranges what the data repository imported as root's; only the
        # capabilities that moving files in that tree needs.
        container = {
            "name": "prepare",
            "image": image,
            "command": ["python", "-m", TRAINER_MODULE, "prepare-imagenet", dataset_path,
                        "--labels", f"{dataset_path}/{labels_file}"],
            "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
            "volumeMounts": [*mounts, {"name": "tmp", "mountPath": "/tmp"}],
            "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "DAC_OVERRIDE", "FOWNER"]}},
        }
        pod = PodTemplate(
            restart_policy="Never",
            service_account=TRAINER_SERVICE_ACCOUNT,
            node_selector={NODE_ROLE_LABEL: SYSTEM_ROLE},
            security_context={"seccompProfile": {"type": "RuntimeDefault"}},
            containers=[container],
            volumes=[*volumes, {"name": "tmp", "emptyDir": {}}],
            fields=ONE_OFF_POD_FIELDS,
        )
        k8s_object(self, "job", api_version="batch/v1", kind="Job",
                   metadata={"name": "prepare-imagenet", "namespace": config.jobs.namespace,
                             "labels": {"app.kubernetes.io/name": "prepare-imagenet",
                                        "app.kubernetes.io/part-of": "training-platform"},
                             "annotations": checkov_skips(skips)},
                   spec={"backoffLimit": 2, "ttlSecondsAfterFinished": config.jobs.ttl_seconds_after_finished,
                         "template": pod.to_dict()})
