"""Charts rendered per job: the elastic training job, the EFA/NCCL check, and data preparation."""

from __future__ import annotations

from cdk8s import Chart
from constructs import Construct

from config import PlatformConfig
from config.catalog import INSTANCE_TYPE_LABEL, NODE_ROLE_LABEL, SYSTEM_ROLE
from k8s_charts.job_spec import FSX_MOUNT, JobSpec
from k8s_charts.objects import k8s_object
from k8s_charts.platform_charts import FSX_CLAIM, TRAINER_SERVICE_ACCOUNT, etcd_endpoint
from training.launch import LAUNCH_ENVIRONMENT, TRAINER_MODULE, torchrun_arguments

# Kept free on every node for the kubelet, the OS and the platform's DaemonSets.
RESERVED_VCPUS = 4
RESERVED_MEMORY_FRACTION = 0.10
SHM_FRACTION = 0.25  # /dev/shm (DataLoader workers pass batches through it), of the pod's memory
# SIGTERM to the pod -> torchrun -> workers checkpoint; torchrun waits 30 s before SIGKILL.
TERMINATION_GRACE_SECONDS = 120


def nccl_environment(efa: bool, rdma: bool) -> dict[str, str]:
    """NCCL over EFA (DESIGN.md); without EFA only the interface and error settings apply."""
    env = {
        "NCCL_SOCKET_IFNAME": "^lo,docker,pod-id-link",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    if efa:
        env.update(FI_PROVIDER="efa", FI_EFA_FORK_SAFE="1")
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


def _trainer_flags(spec: JobSpec) -> list[str]:
    flags = [f"--config={spec.trainer_config}"] if spec.trainer_config else []
    args = {**spec.trainer_args, "checkpoint.dir": spec.checkpoint_dir()}
    if spec.dataset_path:
        args.setdefault("data.path", spec.dataset_path)
    return flags + [f"--{key}={_scalar(value)}" for key, value in args.items()]


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        import json

        return json.dumps(value)
    return str(value)


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
        # Volcano names a job's PodGroup <job>-<uid>: unique for every submission, the same
        # for all its pods and their restarts. Resubmitting a job never meets an old round.
        {"name": "RDZV_ID", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['scheduling.k8s.io/group-name']"}}},
    ]


def torchrun_command(spec: JobSpec, config: PlatformConfig, trainer: list[str]) -> list[str]:
    """``torchrun <platform flags> -m training <trainer args>``."""
    flags = torchrun_arguments(
        min_nodes=spec.min_nodes, max_nodes=spec.max_nodes, nproc_per_node=spec.nproc_per_node(config),
        endpoint=etcd_endpoint(config), run_id="$(RDZV_ID)", max_restarts=spec.max_restarts,
        local_addr="$(POD_IP)",
    )
    return ["torchrun", *flags, "-m", TRAINER_MODULE, *trainer]


class _VolcanoJobChart(Chart):
    """A Volcano Job of min..max identical pods, one per node, running torchrun."""

    def __init__(self, scope: Construct, id: str, config: PlatformConfig, spec: JobSpec, name: str,
                 trainer: list[str], extra_env: dict[str, str] | None = None):
        super().__init__(scope, id)
        group = spec.group(config)
        instance = group.instance
        resources = pod_resources(spec, config)
        memory_gib = int(resources["requests"]["memory"].removesuffix("Gi"))
        volumes, mounts = _shared_volumes(memory_gib)
        efa = spec.efa_devices(config) > 0
        env = {**nccl_environment(efa, rdma=instance.accelerator_model in ("A100", "H100", "H200", "Trainium",
                                                                           "Trainium2")),
               **LAUNCH_ENVIRONMENT, "OMP_NUM_THREADS": "1", **(extra_env or {}), **spec.env}
        labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "training-platform"}
        container = {
            "name": "trainer",
            "image": spec.image,
            # The kubelet expands $(POD_IP) and $(RDZV_ID) from the container's env; no shell needed.
            "command": torchrun_command(spec, config, trainer),
            "env": _downward_env() + _env(env),
            "resources": resources,
            "volumeMounts": mounts,
        }
        k8s_object(self, "job", api_version="batch.volcano.sh/v1alpha1", kind="Job",
                  metadata={"name": name, "namespace": config.jobs.namespace, "labels": labels},
                  spec={
                      "schedulerName": "volcano",
                      "queue": spec.queue or config.jobs.queue.name,
                      "priorityClassName": spec.priority_class or config.jobs.priority_class.name,
                      "minAvailable": spec.min_nodes,
                      "maxRetry": spec.max_restarts,
                      "ttlSecondsAfterFinished": config.jobs.ttl_seconds_after_finished,
                      # svc: a headless Service and hostnames; env: VC_TASK_INDEX. torchrun needs neither
                      # for rendezvous (etcd), but they make pods addressable for debugging.
                      "plugins": {"svc": [], "env": []},
                      # A lost pod restarts the whole job (all pods re-rendezvous and resume from
                      # the newest checkpoint); torchrun inside a pod handles worker failures itself.
                      "policies": [{"event": "PodEvicted", "action": "RestartJob"},
                                   {"event": "PodFailed", "action": "RestartJob"}],
                      "tasks": [{
                          "name": "worker",
                          "replicas": spec.max_nodes,
                          "minAvailable": spec.min_nodes,
                          "template": {
                              "metadata": {"labels": labels},
                              "spec": {
                                  "restartPolicy": "Never",
                                  "serviceAccountName": TRAINER_SERVICE_ACCOUNT,
                                  "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
                                  "nodeSelector": {INSTANCE_TYPE_LABEL: instance.name},
                                  "tolerations": [{"key": instance.taint_key, "operator": "Exists",
                                                   "effect": "NoSchedule"}],
                                  "containers": [container],
                                  "volumes": volumes,
                              },
                          },
                      }],
                  })


class TrainingJobChart(_VolcanoJobChart):
    """The elastic training job: ``torchrun ... -m training train <the spec's trainer args>``."""

    def __init__(self, scope: Construct, id: str, config: PlatformConfig, spec: JobSpec):
        super().__init__(scope, id, config, spec, spec.name, ["train", *_trainer_flags(spec)])


class NcclCheckChart(_VolcanoJobChart):
    """An all-reduce bandwidth sweep over the job's nodes; fails if EFA was wanted and NCCL is not on it."""

    def __init__(self, scope: Construct, id: str, config: PlatformConfig, spec: JobSpec):
        sweep = ["allreduce-bench", "--max-bytes=2147483648"]
        if spec.efa_devices(config):
            sweep.append("--require-efa")
        check = spec.model_copy(update={"name": f"{spec.name}-nccl", "min_nodes": spec.max_nodes, "max_restarts": 0})
        super().__init__(scope, id, config, check, check.name, sweep)


class DataPrepChart(Chart):
    """Checks the imported ImageNet copy on FSx, rearranges val/ into class folders, writes a manifest."""

    def __init__(self, scope: Construct, id: str, config: PlatformConfig, image: str,
                 dataset_path: str = f"{FSX_MOUNT}/datasets/imagenet", labels_file: str = "LOC_val_solution.csv"):
        super().__init__(scope, id)
        volumes, mounts = _shared_volumes(memory_gib=4)
        k8s_object(self, "job", api_version="batch/v1", kind="Job",
                  metadata={"name": "prepare-imagenet", "namespace": config.jobs.namespace,
                            "labels": {"app.kubernetes.io/name": "prepare-imagenet",
                                       "app.kubernetes.io/part-of": "training-platform"}},
                  spec={
                      "backoffLimit": 2,
                      "ttlSecondsAfterFinished": config.jobs.ttl_seconds_after_finished,
                      "template": {"spec": {
                          "restartPolicy": "Never",
                          "serviceAccountName": TRAINER_SERVICE_ACCOUNT,
                          "nodeSelector": {NODE_ROLE_LABEL: SYSTEM_ROLE},
                          "containers": [{
                              "name": "prepare",
                              "image": image,
                              "command": ["python", "-m", TRAINER_MODULE, "prepare-imagenet", dataset_path,
                                          "--labels", f"{dataset_path}/{labels_file}"],
                              "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
                              "volumeMounts": mounts,
                          }],
                          "volumes": volumes,
                      }},
                  })
