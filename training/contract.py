"""The contract between the platform and the code in the image: one torch-free, CDK-free module.

Both sides import it and nothing else of each other. The deploy side (charts, constructs,
trainctl) builds pod commands and environments from it; the launcher, agent, rendezvous and
trainer read the same names. It holds:

- how a training pod is launched: :func:`launch_command` (torchrun's flags, the platform's
  rendezvous and its tuning) and the AWS Batch and Slurm variants;
- the exit statuses the job controllers act on, the environment names the launcher and the
  trainer share, and checkpoint file names;
- how an etcd member of the rendezvous store is started (:func:`etcd_arguments`), its ports,
  and where pods find their client certificate.

It imports nothing of the project.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

RDZV_BACKEND = "platform-etcd"
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
# Set in every training pod. The platform-etcd rendezvous never shares an agent's TCPStore with
# the workers (use_agent_store is false); this keeps torch's own backends from doing so too, where
# a joining node waits forever for the master address (pytorch issues 135712 / 147064).
LAUNCH_ENVIRONMENT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
TRAINER_MODULE = "training"
LAUNCHER_MODULE = "training.launcher"
# What a pod runs after torchrun's flags when its job names no program of its own: the packaged trainer.
TRAINER_PROGRAM = ("-m", TRAINER_MODULE, "train")
# How the launcher starts the packaged trainer's workers: from a server process that imported the trainer.
WARM_START_METHOD = "forkserver"

# The launcher in an image that lacks this package (a job's own program, docs/job-spec.md, "Your own torchrun program"):
# these files, torch-free apart from the launcher's own use of torch.distributed, are copied from the
# platform's image (where they lie under PLATFORM_APP_DIR, training/docker/Dockerfile.*) into an empty
# volume mounted at LAUNCHER_MOUNT, and the pod runs LAUNCHER_ENTRY as a script: Python puts the
# script's folder first on the path (training/launcher/__main__.py then puts LAUNCHER_MOUNT there), so
# neither the image's PYTHONPATH nor its working directory changes, and the program's workers, started
# as fresh interpreters, find nothing of this package.
LAUNCHER_PACKAGE = ("training/__init__.py", "training/contract.py", "training/launcher")
PLATFORM_APP_DIR = "/app"
LAUNCHER_MOUNT = "/platform-launcher"
LAUNCHER_ENTRY = f"{LAUNCHER_MOUNT}/training/launcher/__main__.py"
# Given to a job's own program: the folder on FSX_MOUNT where its checkpoints belong (the spec's
# checkpoint_path). The launcher counts a newer numbered entry there as progress (program_checkpoint_step).
CHECKPOINT_DIR_ENV = "PLATFORM_CHECKPOINT_DIR"


def launcher_copy_command(destination: str = LAUNCHER_MOUNT) -> list[str]:
    """The command, run in PLATFORM_APP_DIR of the platform's image, that copies the launcher to ``destination``."""
    return ["cp", "-R", "--parents", *LAUNCHER_PACKAGE, f"{destination}/"]


def program_arguments(*, module: str | None = None, script: str | None = None, args: Sequence[str] = ()) -> list[str]:
    """What follows torchrun's flags for a program: ``-m <module> <args>`` or ``<script> <args>``."""
    if (module is None) == (script is None):
        raise ValueError("a program is a module or a script, not both or neither")
    return [*(["-m", module] if module else [script]), *args]

# The shared file system (FSx for Lustre): where pods and AWS Batch hosts mount it, and the
# folders a job's spec, the charts and the trainer agree on.
FSX_MOUNT = "/fsx"
DATASETS_DIR = f"{FSX_MOUNT}/datasets"  # linked to s3://<bucket>/<fsx.data_prefix>


def checkpoint_dir(job: str) -> str:
    """A job's checkpoints, unless its spec names another folder under FSX_MOUNT."""
    return f"{FSX_MOUNT}/checkpoints/{job}"


def staging_dir(job: str) -> str:
    """Where a job's checkpoint writes are staged: same file system, outside the S3-linked tree."""
    return f"{FSX_MOUNT}/staging/{job}"


def cache_dir(job: str) -> str:
    """A job's compiler caches (Neuron, inductor), kept across restarts."""
    return f"{FSX_MOUNT}/cache/{job}"


# Node labels the cluster applies and the charts select on.
NODE_ROLE_LABEL = "training-platform/node-role"
SYSTEM_ROLE, ACCELERATED_ROLE = "system", "accelerated"
ACCELERATOR_LABEL = "training-platform/accelerator"  # nvidia | neuron: device plugins select on it
NODE_GROUP_LABEL = "training-platform/node-group"
# The NoSchedule taint of an accelerated node group, by accelerator: only pods that tolerate it
# (device plugins, training jobs) land on accelerated nodes.
ACCELERATOR_TAINTS = {"nvidia": "nvidia.com/gpu", "neuron": "aws.amazon.com/neuron"}
ACCELERATOR_TAINT_EFFECT = "NoSchedule"

# The network topology EKS puts on a node (the AWS cloud controller manager, kubernetes/cloud-provider-aws
# pkg/providers/v1/instances_v2.go getAdditionalLabels, v1.32.0; once, when the node initializes): one
# label per layer of EC2 DescribeInstanceTopology's NetworkNodes, numbered in the order EC2 lists them,
# top down. So layer 1 is the top of the network and the highest layer present is the network node the
# instance hangs from (layer 3 on every type of the catalog; EC2 User Guide, "How Amazon EC2 instance
# topology works"). The values are per-account hashes: compared only for equality. Types EC2 gives no
# topology for, and nodes whose lookup failed, carry none.
NETWORK_NODE_LABEL_PREFIX = "topology.k8s.aws/network-node-layer-"


def network_node_label(layer: int) -> str:
    return f"{NETWORK_NODE_LABEL_PREFIX}{layer}"


# A JSON file of the node's labels, written by the training pod's init container: the agent gives its node
# a rank next to its network neighbours (training/launcher/topology.py). Unset or absent: no network order.
NODE_LABELS_FILE_ENV = "PLATFORM_NODE_LABELS_FILE"
NODE_LABELS_MODULE = "training.node_labels"  # python -m it PATH: the init container that writes the file

# The node check (training/node_check, run on every accelerated node by the platform's DaemonSet,
# k8s_charts/node_check.py): new accelerated nodes register with NODE_CHECK_TAINT (NoSchedule), next to
# their accelerator's taint, and only the check removes it, once the node passed. The key's prefix is
# cluster-autoscaler's startup-taint prefix (kubernetes/autoscaler cluster-autoscaler-1.34.2,
# utils/taints/taints.go: StartupTaintPrefix): the autoscaler leaves the taint out of the node templates
# it scales groups up with, so a pending pod that does not tolerate it still brings a node, and counts a
# tainted new node as starting, not as capacity, for its first 15 minutes (clusterstate.go,
# MaxNodeStartupTime). EKS takes taint keys of at most 63 characters (API_Taint).
NODE_CHECK_TAINT = "startup-taint.cluster-autoscaler.kubernetes.io/node-check"
NODE_CHECK_TAINT_VALUE = "pending"
# What the check found, on the node: NODE_PASSED or NODE_FAILED, and for a failure the first check that
# failed (a NodeCheck name of training/node_check/checks.py). Jobs need not select on them: the taint decides.
NODE_HEALTH_LABEL = "training-platform/node-health"
NODE_PASSED, NODE_FAILED = "passed", "failed"
NODE_FAILED_CHECK_LABEL = "training-platform/failed-check"
# cluster-autoscaler leaves a node with this annotation alone when it scales down (its FAQ, "How can I
# prevent Cluster Autoscaler from scaling down a particular node?"): a failed node kept for a look.
SCALE_DOWN_DISABLED_ANNOTATION = "cluster-autoscaler.kubernetes.io/scale-down-disabled"
NODE_CHECK_MODULE = "training.node_check"
NODE_CHECK_EVENT = "node_check"  # the JSON line the check prints (the dashboard's metric filter reads it)
# The DaemonSet's environment besides the node's name (NODE_NAME_ENV, from the downward API): what each
# instance type of the config's groups must show, as JSON {instance type: {"accelerator", "devices", "efa"}}
# (from the instance catalog); the DCGM diagnostic level; what becomes of a node that failed (NODE_FAILURE_ACTIONS).
NODE_CHECK_EXPECTED_ENV = "PLATFORM_NODE_CHECK_EXPECTED"
NODE_CHECK_DCGM_LEVEL_ENV = "PLATFORM_NODE_CHECK_DCGM_LEVEL"
NODE_CHECK_ON_FAILURE_ENV = "PLATFORM_NODE_CHECK_ON_FAILURE"
# keep: the node stays, tainted and out of cluster-autoscaler's scale-down, for someone to look at;
# terminate: its instance is terminated through its Auto Scaling group, which starts a replacement.
NODE_FAILURE_ACTIONS = ("keep", "terminate")

# Exit statuses, which the agent and the job controller's policies act on (k8s_charts/job_charts.py).
EXIT_MEMBERSHIP_CHANGE = 75  # a worker stopped only because a peer was told to: restart into a new round
EXIT_DIVERGED = 76  # the loss is not finite: retrying from the last checkpoint would diverge again
# The workers failed for good and no checkpoint was written since this agent started, or the agent
# failed (its rendezvous, its network) in a job without any checkpoint: a fresh incarnation would start
# from the same place and fail the same way. The job ends.
EXIT_CRASH_LOOP = 77
# EX_CONFIG: the config, the data, the checkpoint dir or the image (a torch the launcher cannot run on, an
# error of the launcher itself) is wrong; nothing retries it.
EXIT_CONFIG = 78
EXIT_RESTART_JOB = 79  # this incarnation cannot go on (workers failed for good after progress): restart afresh
# This node was named a straggler under metrics.straggler_policy=replace: its workers wrote the job's
# checkpoint with the others, tainted their node (STRAGGLER_TAINT) and left; the agent leaves the
# rendezvous at once and the pod ends, the survivors go on from memory, and the controller starts
# another pod, which cannot land on the tainted node (k8s_charts/job_charts.py, job_policies).
EXIT_REPLACE_NODE = 74
# The agent's own exit when the pod's SIGTERM stopped it (a drain, a Spot reclaim, a scale-down):
# the workers were asked to checkpoint (the launcher's log says whether they did), and the controller
# recreates the deleted pod without counting a retry.
EXIT_STOPPED = 128 + 15
# A worker that exits with one of these ends the job at once: no layer retries it.
FINAL_EXITS = (EXIT_DIVERGED, EXIT_CONFIG)
# Seconds between the pod's SIGTERM and the end of its grace period kept for the agent itself.
SHUTDOWN_MARGIN_S = 15
# Environment the launcher and the charts give the trainer.
STOP_BUDGET_ENV = "PLATFORM_STOP_BUDGET_S"  # seconds a SIGTERM leaves the workers before SIGKILL
SPOT_NOTICE_ENV = "PLATFORM_SPOT_NOTICE"  # "imds": watch for the two-minute Spot interruption notice
IMDS_ENDPOINT_ENV = "PLATFORM_IMDS_ENDPOINT"  # the instance metadata service; tests point it at loopback
AGENT_PID_ENV = "PLATFORM_AGENT_PID"  # the launcher's pid: a worker whose parent is not it is an orphan
# The job's --nnodes minimum, for the workers: a straggler's node is replaced only while the job keeps it.
MIN_NODES_ENV = "PLATFORM_MIN_NODES"
# What the trainer does with a straggler it named (metrics.straggler_policy): report it, or replace its
# node: the node gets STRAGGLER_TAINT (NoSchedule: no pod lands there again; cluster-autoscaler removes it
# once idle) and the job shrinks and grows back onto another node. Only the node's own pod may set it
# (k8s_charts/own_node.py), through the token the job's pods then carry.
STRAGGLER_POLICIES = ("report", "replace")
STRAGGLER_TAINT = "training-platform/straggler"
# Where a rank runs, named in its straggler events (training/loop/stragglers.py): the pod's name and
# its node's from the downward API, the instance type from the job's node group.
POD_NAME_ENV = "PLATFORM_POD_NAME"
NODE_NAME_ENV = "PLATFORM_NODE_NAME"
INSTANCE_TYPE_ENV = "PLATFORM_INSTANCE_TYPE"
# A file the packaged trainer touches when it has trained (its first step of a round, then every report):
# the rendezvous counts a round's training time from there before it admits waiting nodes.
PROGRESS_FILE_ENV = "PLATFORM_PROGRESS_FILE"
# A folder of the agent's where it and its workers meet to change rounds in place: the agent sends
# REGROUP_SIGNAL, each worker stops at an agreed step, leaves its process group and writes
# paused-<local rank>; the agent joins the next round and writes membership-<local rank>.json
# (training/launcher/agent.py). A worker whose group broke under it (a collective failed: a peer
# died) keeps its state, writes broken-<local rank> and pauses the same way; the agent hands it a place
# in the round without the lost peer, or, when no peer was lost, a membership whose env is null, and
# the worker then fails with its error as it would have.
CONTROL_DIR_ENV = "PLATFORM_CONTROL_DIR"
PAUSED_FILE = "paused"
MEMBERSHIP_FILE = "membership"
BROKEN_MARKER = "broken"
# Written by a worker that can keep its state through a lost peer (recovers-<local rank>): gloo, or NCCL
# with distributed.nccl_recovery; its updates skippable on the device once the group breaks
# (training/loop/lost_peer.py: a fused optimizer, no fp16 scaler). Other workers restart from the checkpoint.
RECOVERS_MARKER = "recovers"
CONTROL_FILES = (PAUSED_FILE, MEMBERSHIP_FILE, BROKEN_MARKER, RECOVERS_MARKER)


def control_file(kind: str, local_rank: int | str) -> str:
    """A worker's file in its agent's control folder: ``<kind>-<local rank>``; the membership, a JSON
    document, ``membership-<local rank>.json``."""
    return f"{kind}-{local_rank}" + (".json" if kind == MEMBERSHIP_FILE else "")


def control_glob(kind: str) -> str:
    """Every worker's files of ``kind`` in the control folder, a half-written ``.partial`` one included."""
    return f"{kind}-*"


REGROUP_SIGNAL = 10  # SIGUSR1 on Linux
# Sent by the agent to workers that recover (RECOVERS_MARKER) when the rendezvous reports a lost peer: a
# worker blocked in a collective on a peer that died silently (no connection reset: power, partition)
# breaks its group from a thread (gloo: shuts its connections; NCCL: aborts the communicators), so the
# collective ends now instead of at distributed.timeout_s.
LOST_PEER_SIGNAL = 12  # SIGUSR2 on Linux
# Sent by the agent to a worker that did not pause when asked (before it restarts it): the worker writes
# every thread's Python stack to its stderr (faulthandler, which answers from C, also while the main
# thread is blocked in C++), so the agent's log says where it was. SIGRTMIN + 2 on Linux: unused by torch.
STACKS_SIGNAL = 36
# Present in the control folder while a worker writes a checkpoint (writing-<local rank>): an agent
# stopping workers that lost a peer waits for it to go before the SIGKILL.
WRITING_MARKER = "writing"
# "0": on an admission and after a lost peer, stop and restart the workers as torchrun does (they resume from
# the newest checkpoint), instead of moving them to the next round with their state.
REGROUP_IN_PLACE_ENV = "PLATFORM_REGROUP_IN_PLACE"
# The JSON line each node's agent prints to its log when a rendezvous gives it its place: the
# global ranks its workers hold. A pod's index in its job is not its rank once the job regrouped;
# `trainctl logs --rank` finds the pod that holds a rank from these lines.
NODE_RANKS_EVENT = "node_ranks"


@dataclass(frozen=True)
class RendezvousTuning:
    """``--rdzv-conf`` of the ``platform-etcd`` rendezvous (training/launcher/rendezvous.py); chosen with
    benchmarks/elastic_scale.py at 2 to 16 agents (docs/elasticity-and-checkpoints.md, "Elasticity at scale")."""

    # Liveness: a lease renewed this often; a dead node's key goes when the lease expires. etcd
    # raises a TTL to its minimum, 1 s with the platform's etcd flags (--heartbeat-interval=50
    # --election-timeout=500; 2 s with etcd's defaults).
    keep_alive_interval: float = 0.25
    lease_ttl: float = 1
    # A job's first round waits this long after the last arrival, so nodes starting together join together.
    last_call_timeout: float = 2.0
    # Nodes that arrive while a round runs are admitted together once it has trained this long.
    scale_up_after_s: float = 30.0
    join_timeout: int = 900  # a pod may wait this long for the minimum number of nodes
    # etcd may be away this long (longer than a reschedule off a dead node: ~6 min with the
    # default 300 s not-ready toleration) before an agent gives up.
    outage_tolerance: int = 600
    read_timeout: int = 5  # one etcd request

    def conf(self) -> str:
        return ",".join(f"{f.name}={_number(getattr(self, f.name))}" for f in fields(self))


PLATFORM_TUNING = RendezvousTuning()


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)




def torchrun_arguments(
    *,
    min_nodes: int,
    max_nodes: int,
    nproc_per_node: int,
    endpoint: str,
    run_id: str,
    max_restarts: int,
    tuning: RendezvousTuning | None = PLATFORM_TUNING,
    local_addr: str | None = None,
    backend: str = RDZV_BACKEND,
) -> list[str]:
    """The torchrun flags (without the launcher and the module) for one elastic job.

    ``tuning=None`` leaves torch's defaults, for comparisons.
    """
    args = [
        f"--nnodes={min_nodes}:{max_nodes}",
        f"--nproc-per-node={nproc_per_node}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={max_restarts}",
    ]
    if tuning is not None:
        args.append(f"--rdzv-conf={tuning.conf()}")
    if local_addr:
        args.append(f"--local-addr={local_addr}")
    return args


def _launcher(python: str, program: Sequence[str], launcher: str | None) -> tuple[list[str], list[str]]:
    """(the launcher's argv, the start method flag) for ``program``. The packaged trainer's workers come
    from a forkserver that has imported it (training/launcher/workers.py: never forked from the agent,
    which may have started the GPU driver); a program of the job's own is a fresh interpreter per worker
    (torchrun starts a binary entrypoint as a subprocess)."""
    start = [f"--start-method={WARM_START_METHOD}"] if tuple(program[:2]) == TRAINER_PROGRAM[:2] else []
    return ([python, launcher] if launcher else [python, "-m", LAUNCHER_MODULE]), start


def launch_command(*, min_nodes: int, max_nodes: int, nproc_per_node: int, endpoint: str, run_id: str,
                   max_restarts: int, local_addr: str | None = None, python: str = "python",
                   grace_period_s: int | None = None, tuning: RendezvousTuning = PLATFORM_TUNING,
                   program: Sequence[str] = TRAINER_PROGRAM, launcher: str | None = None) -> list[str]:
    """The full argv of a training pod: the launcher, torchrun's flags, then ``program``
    (:func:`program_arguments`; by default ``-m training train``, to which the trainer's overrides are appended).

    ``grace_period_s`` is the pod's termination grace period: the agent gives its workers that
    much, less a margin for itself, between forwarding SIGTERM and SIGKILL (torchrun's default
    is 30 s, whatever the pod allows). ``launcher``: the launcher's entry script in an image that
    lacks this package (LAUNCHER_ENTRY); None runs ``python -m training.launcher``.
    """
    flags = torchrun_arguments(min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node,
                               endpoint=endpoint, run_id=run_id, max_restarts=max_restarts, tuning=tuning,
                               local_addr=local_addr)
    argv, start = _launcher(python, program, launcher)
    flags += start
    if grace_period_s is not None:
        flags.append(f"--shutdown-timeout={shutdown_timeout(grace_period_s)}")
    return [*argv, *flags, *program]


# AWS Batch multi-node parallel jobs: a fixed number of nodes, each told its index, the count and
# the main node's address in its environment (Batch User Guide, "Multi-node parallel jobs",
# environment variables). The container command carries this flag; the launcher replaces it,
# on each node, by torchrun's static rendezvous at the main node.
BATCH_NODE_FLAG = "--aws-batch-mnp"
BATCH_MASTER_PORT = 29500
# Batch's container stop: SIGTERM, then SIGKILL after ECS's default stop timeout of 30 s.
BATCH_STOP_GRACE_S = 30


class BatchEnvironmentError(ValueError):
    """The Batch variables are missing or wrong: the command ran outside a Batch MNP job."""


def batch_launch_command(*, nproc_per_node: int, max_restarts: int, python: str = "python",
                         master_port: int = BATCH_MASTER_PORT, program: Sequence[str] = TRAINER_PROGRAM,
                         launcher: str | None = None) -> list[str]:
    """The container command of an AWS Batch multi-node parallel job, ending with ``program`` (by
    default ``-m training train``: append the trainer's overrides). The node's place in the job is
    read from Batch's environment when the container starts (:func:`batch_rendezvous_arguments`)."""
    argv, start = _launcher(python, program, launcher)
    return [*argv, BATCH_NODE_FLAG, f"--nproc-per-node={nproc_per_node}",
            f"--max-restarts={max_restarts}", f"--master-port={master_port}", *start,
            f"--shutdown-timeout={shutdown_timeout(BATCH_STOP_GRACE_S)}", *program]


def batch_rendezvous_arguments(environ: dict[str, str]) -> list[str]:
    """torchrun's static rendezvous for this node of a Batch MNP job.

    The main node hosts the store (node rank 0) and does not get its own address in the
    environment (Batch sets AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS on the other nodes
    only). Each attempt of the job is its own run: AWS_BATCH_JOB_ID is ``<job>#<node>`` on a node.
    """
    try:
        index = int(environ["AWS_BATCH_JOB_NODE_INDEX"])
        nodes = int(environ["AWS_BATCH_JOB_NUM_NODES"])
        main = int(environ.get("AWS_BATCH_JOB_MAIN_NODE_INDEX", "0"))
        job = environ["AWS_BATCH_JOB_ID"].split("#")[0]
    except (KeyError, ValueError) as exc:
        raise BatchEnvironmentError(f"{BATCH_NODE_FLAG}: AWS Batch's job variables are missing or invalid "
                                    f"({exc}); allowed: inside an AWS Batch multi-node parallel job") from None
    address = "127.0.0.1" if index == main else environ.get("AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS")
    if not address:
        raise BatchEnvironmentError(f"{BATCH_NODE_FLAG}: node {index} has no AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_"
                                    "ADDRESS; allowed: inside an AWS Batch multi-node parallel job")
    attempt = environ.get("AWS_BATCH_JOB_ATTEMPT", "1")
    return [f"--nnodes={nodes}", f"--node-rank={(index - main) % nodes}", "--rdzv-backend=static",
            f"--master-addr={address}", f"--rdzv-id={job}-{attempt}"]


# Slurm (AWS ParallelCluster): sbatch allocates the nodes, one task per node runs the launcher, and the
# job is requeued whole when a node fails. The allocation's size is fixed once the job starts (any of
# min..max), so, as on Batch, the launcher replaces this flag on each node by torchrun's static
# rendezvous at the allocation's first node, read from the task's Slurm variables (srun(1), "OUTPUT
# ENVIRONMENT VARIABLES"): SLURM_NODEID is the node's index in the step, SLURM_LAUNCH_NODE_IPADDR the
# address of the node srun ran on, the batch host, which is the first node of the allocation and so
# node 0 of a step over all of it. Each requeued incarnation (SLURM_RESTART_COUNT, absent on the
# first) is a run of its own.
SLURM_NODE_FLAG = "--slurm-job"
SLURM_MASTER_PORT = 29500
# A file the launcher creates when it asks for a fresh incarnation (EXIT_RESTART_JOB). Under srun one
# node's exit status is lost: --kill-on-bad-exit stops the other nodes' tasks, which then exit 143,
# and srun returns the highest status of all tasks (srun(1), "RETURN VALUE"). The script requeues on it.
RESTART_MARKER_ENV = "PLATFORM_RESTART_MARKER"
# The slurm stack's KillWait (ParallelCluster's own is 30 s, slurm.conf.erb of aws-parallelcluster-cookbook):
# on scancel, a time limit or a requeue Slurm sends SIGTERM, then SIGKILL this much later (slurm.conf(5),
# KillWait). As long as a training pod's grace period on EKS, so a stop checkpoint fits on either.
SLURM_KILL_WAIT_S = 120


class SlurmEnvironmentError(ValueError):
    """The Slurm task variables are missing or wrong: the command ran outside an srun step."""


def slurm_launch_command(*, nproc_per_node: int, max_restarts: int, kill_wait_s: int = SLURM_KILL_WAIT_S,
                         python: str = "python",
                         master_port: int = SLURM_MASTER_PORT, program: Sequence[str] = TRAINER_PROGRAM,
                         launcher: str | None = None) -> list[str]:
    """The command each node's task of a Slurm job runs, ending with ``program``. ``kill_wait_s`` is
    the cluster's KillWait, Slurm's time between SIGTERM and SIGKILL when it ends a job: the workers'
    stop budget lies inside it."""
    argv, start = _launcher(python, program, launcher)
    return [*argv, SLURM_NODE_FLAG, f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}",
            f"--master-port={master_port}", *start, f"--shutdown-timeout={shutdown_timeout(kill_wait_s)}",
            *program]


def slurm_rendezvous_arguments(environ: Mapping[str, str]) -> list[str]:
    """torchrun's static rendezvous for this node's task of a Slurm job (see SLURM_NODE_FLAG)."""
    try:
        job = int(environ["SLURM_JOB_ID"])
        index = int(environ["SLURM_NODEID"])
        nodes = int(environ["SLURM_JOB_NUM_NODES"])
        restart = int(environ.get("SLURM_RESTART_COUNT", "0"))
        address = environ["SLURM_LAUNCH_NODE_IPADDR"]
    except (KeyError, ValueError) as exc:
        raise SlurmEnvironmentError(f"{SLURM_NODE_FLAG}: Slurm's task variables are missing or invalid ({exc}); "
                                    "allowed: inside an srun step of a Slurm job") from None
    if not 0 <= index < nodes:
        raise SlurmEnvironmentError(f"{SLURM_NODE_FLAG}: SLURM_NODEID {index} is not one of the job's {nodes} "
                                    "nodes; allowed: one task per node of the whole allocation")
    return [f"--nnodes={nodes}", f"--node-rank={index}", "--rdzv-backend=static", f"--master-addr={address}",
            f"--rdzv-id=slurm-{job}-{restart}"]


def shutdown_timeout(grace_period_s: int) -> int:
    """Seconds the workers get to checkpoint after SIGTERM, inside the pod's grace period."""
    if grace_period_s <= SHUTDOWN_MARGIN_S:
        raise ValueError(f"a grace period of {grace_period_s} s leaves no time to checkpoint; allowed: more than "
                         f"{SHUTDOWN_MARGIN_S} s")
    return grace_period_s - SHUTDOWN_MARGIN_S


# --- checkpoints ------------------------------------------------------------------------------
# One file per checkpoint, named by its step; the trainer writes and reads them, the agent counts
# progress by them, trainctl finds them in S3.
CHECKPOINT_NAME = re.compile(r"^step-(\d{9})\.pt$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}.pt"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint file's name (a basename or a path), None when it is not one."""
    found = CHECKPOINT_NAME.match(name.rsplit("/", 1)[-1])
    return int(found.group(1)) if found else None


def program_checkpoint_step(name: str) -> int | None:
    """The step of an entry a job's own program wrote to its checkpoint folder: the last number in its
    name (torchtitan's ``step-1000``, DCP folders named by step, Hugging Face's ``checkpoint-500``,
    Lightning's ``epoch=2-step=900.ckpt``). None for a hidden entry (a write in progress, by
    convention) or a name without a number (``latest``, a config file)."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    numbers = re.findall(r"\d+", base)
    return int(numbers[-1]) if numbers and not base.startswith(".") else None


# --- etcd, the rendezvous store -----------------------------------------------------------------

# Members of the platform's etcd: one lost system node leaves a quorum of two, and the jobs see
# no outage at all. The system node group keeps at least this many nodes (config/node_groups.py).
ETCD_MEMBERS = 3
# etcd's Raft timing: a heartbeat every 50 ms and an election after 500 ms (defaults 100 and 1000).
# etcd grants no lease shorter than 1.5 election timeouts, rounded up to whole seconds
# (server/etcdserver/server.go, minTTL): 1 s here instead of 2 s, so a dead node's lease ends
# that much sooner. 50 ms is still tens of times a round trip between nodes of one Region.
ETCD_TIMING = ("--heartbeat-interval=50", "--election-timeout=500")
# Old revisions are dropped after an hour: the rendezvous compares only current revisions and
# never watches history, and without compaction the database would grow to its quota over months
# and turn read-only (etcd's NOSPACE alarm).
ETCD_COMPACTION = ("--auto-compaction-mode=periodic", "--auto-compaction-retention=1h")


# Where pods find the client certificate the platform issues them (a Secret of cert-manager's
# layout: ca.crt, tls.crt, tls.key), and the environment that tells the rendezvous client so
# (training/launcher/etcd_v3.py reads it).
CLIENT_TLS_DIR = "/etc/platform/etcd-tls"


# Environment the platform sets when etcd serves TLS (the paths of PEM files in the pod).
ETCD_CA_ENV = "PLATFORM_ETCD_CA_FILE"
ETCD_CERT_ENV = "PLATFORM_ETCD_CERT_FILE"
ETCD_KEY_ENV = "PLATFORM_ETCD_KEY_FILE"
TLS_ENVIRONMENT = (ETCD_CA_ENV, ETCD_CERT_ENV, ETCD_KEY_ENV)


def client_tls_environment(directory: str = CLIENT_TLS_DIR) -> dict[str, str]:
    return {ETCD_CA_ENV: f"{directory}/ca.crt", ETCD_CERT_ENV: f"{directory}/tls.crt",
            ETCD_KEY_ENV: f"{directory}/tls.key"}


@dataclass(frozen=True)
class MemberTLS:
    """PEM files of one member: its certificate for clients, its certificate for peers, and the CA of both.

    Clients and peers must present a certificate of that CA (``--client-cert-auth``,
    ``--peer-client-cert-auth``). The server certificate needs the clientAuth usage as well as
    serverAuth: etcd's JSON gateway dials the member's own gRPC server with it.
    """

    ca_file: str
    cert_file: str
    key_file: str
    peer_cert_file: str
    peer_key_file: str


def etcd_arguments(name: str, data_dir: str, *, peers: Mapping[str, str], listen_client_urls: Sequence[str],
                   advertise_client_url: str, listen_peer_url: str, cluster_token: str,
                   advertise_peer_url: str | None = None, tls: MemberTLS | None = None,
                   metrics_url: str | None = None) -> list[str]:
    """Flags of member ``name`` of the cluster ``peers`` (member name -> its advertised peer URL).

    ``--initial-cluster*`` is read only when the data dir is empty: a member restarted on its
    data rejoins as the member it was. The URLs carry their scheme; with ``tls`` they must be
    https. ``metrics_url`` serves /health, /livez, /readyz and /metrics without client
    certificates, for the kubelet's probes. ``advertise_peer_url`` defaults to ``peers[name]``;
    a chart passes both with ``$(POD_NAME)`` in them, which the kubelet expands.
    """
    advertise_peer_url = advertise_peer_url or peers.get(name)
    if advertise_peer_url is None:
        raise ValueError(f"member {name!r} is not in the cluster {sorted(peers)}")
    args = [
        f"--name={name}",
        f"--data-dir={data_dir}",
        *ETCD_TIMING,
        *ETCD_COMPACTION,
        f"--listen-client-urls={','.join(listen_client_urls)}",
        f"--advertise-client-urls={advertise_client_url}",
        f"--listen-peer-urls={listen_peer_url}",
        f"--initial-advertise-peer-urls={advertise_peer_url}",
        f"--initial-cluster={','.join(f'{member}={url}' for member, url in peers.items())}",
        "--initial-cluster-state=new",
        f"--initial-cluster-token={cluster_token}",
    ]
    if metrics_url:
        args.append(f"--listen-metrics-urls={metrics_url}")
    if tls:
        args += [
            f"--trusted-ca-file={tls.ca_file}", f"--cert-file={tls.cert_file}", f"--key-file={tls.key_file}",
            "--client-cert-auth=true",
            f"--peer-trusted-ca-file={tls.ca_file}", f"--peer-cert-file={tls.peer_cert_file}",
            f"--peer-key-file={tls.peer_key_file}", "--peer-client-cert-auth=true",
        ]
    return args
