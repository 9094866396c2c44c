"""How the platform launches the trainer: one function builds the container command, one runs it.

:func:`launch_command` is the whole argv of a training pod: the platform's launcher (this
module), torchrun's flags, and ``-m training train``; the trainer's overrides are appended.
The charts, the local cluster and the tests build commands only with it.

``python -m training.launch`` is torchrun with four platform decisions (each measured with
torch 2.13, real agents and a real etcd; see the README's elasticity section):

- the ``platform-etcd`` rendezvous (:mod:`training.rendezvous`) on etcd's v3 API: leases for
  liveness, growth admitted in batches, shrink without a last call, etcd outages up to
  ``outage_tolerance`` waited out, and only the job's success closes a round;
- sub-second keep-alives, which torchrun's own parser cannot take;
- workers forked from the agent, which has imported torch and the trainer already (seconds
  less per restart, and a node joining a running job is warm before it counts as waiting);
- exit statuses the job controller acts on (:data:`EXIT_CONFIG`, :data:`EXIT_RESTART_JOB`).

This module is imported by the charts (no torch there): torch is imported only by :func:`main`.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, fields

RDZV_BACKEND = "platform-etcd"
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
# Set in every training pod. The platform-etcd rendezvous never shares an agent's TCPStore with
# the workers (use_agent_store is false); this keeps torch's own backends from doing so too, where
# a joining node waits forever for the master address (pytorch issues 135712 / 147064).
LAUNCH_ENVIRONMENT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
TRAINER_MODULE = "training"
LAUNCHER_MODULE = "training.launch"

# Exit statuses, which the agent and the job controller's policies act on (k8s_charts/job_charts.py).
EXIT_MEMBERSHIP_CHANGE = 75  # a worker stopped only because a peer was told to: restart into a new round
EXIT_DIVERGED = 76  # the loss is not finite: retrying from the last checkpoint would diverge again
# The workers failed for good and no checkpoint was written since this agent started: a fresh
# incarnation would start from the same checkpoint and fail the same way. The job ends.
EXIT_CRASH_LOOP = 77
EXIT_CONFIG = 78  # EX_CONFIG: the config, the data or the checkpoint dir is wrong; nothing retries it
EXIT_RESTART_JOB = 79  # this incarnation cannot go on (workers failed for good after progress): restart afresh
# The agent's own exit when the pod's SIGTERM stopped it (a drain, a Spot reclaim, a scale-down):
# the workers checkpointed, and the controller recreates the deleted pod without counting a retry.
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
# A file the packaged trainer touches when it has trained (its first step of a round, then every report):
# the rendezvous counts a round's training time from there before it admits waiting nodes.
PROGRESS_FILE_ENV = "PLATFORM_PROGRESS_FILE"
# A folder of the agent's where it and its workers meet to change rounds in place: the agent sends
# REGROUP_SIGNAL, each worker checkpoints, leaves its process group and writes paused-<local rank>;
# the agent joins the next round and writes membership-<local rank>.json (training/agent.py).
CONTROL_DIR_ENV = "PLATFORM_CONTROL_DIR"
REGROUP_SIGNAL = 10  # SIGUSR1 on Linux
# Present in the control folder while a worker writes a checkpoint (writing-<local rank>): an agent
# stopping workers that lost a peer waits for it to go before the SIGKILL.
WRITING_MARKER = "writing"
# "0": on an admission, stop and restart the workers as torchrun does, instead of regrouping in place.
REGROUP_IN_PLACE_ENV = "PLATFORM_REGROUP_IN_PLACE"
_PR_SET_PDEATHSIG = 1

log = logging.getLogger("training.launch")


@dataclass(frozen=True)
class RendezvousTuning:
    """``--rdzv-conf`` of the ``platform-etcd`` rendezvous (training/rendezvous.py); chosen with
    benchmarks/elastic_scale.py at 2 to 16 agents (README, "Elasticity at scale")."""

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


def die_with_agent() -> None:
    """First thing in a worker: ask Linux to SIGKILL it when its agent dies, and exit if it already has.

    torchrun starts workers in their own session, so a killed agent (OOM, a pod deleted with
    force) would leave them training alone, holding the GPUs and writing checkpoints. The
    request is made before anything slow (importing torch takes seconds), and the parent is
    compared with the pid the launcher exported: an agent that died before the request took
    effect has left this worker with another parent. Needs only the standard library.
    """
    expected = os.environ.get(AGENT_PID_ENV)
    if expected is None and "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # not under an agent: a local run or a test
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if expected is not None and os.getppid() != int(expected):
        print(f"the agent (pid {expected}) is gone; this worker exits instead of training alone", file=sys.stderr)
        os._exit(1)


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


def launch_command(*, min_nodes: int, max_nodes: int, nproc_per_node: int, endpoint: str, run_id: str,
                   max_restarts: int, local_addr: str | None = None, python: str = "python",
                   grace_period_s: int | None = None, tuning: RendezvousTuning = PLATFORM_TUNING) -> list[str]:
    """The full argv of a training pod, ending with ``-m training train``; append the trainer's overrides.

    ``grace_period_s`` is the pod's termination grace period: the agent gives its workers that
    much, less a margin for itself, between forwarding SIGTERM and SIGKILL (torchrun's default
    is 30 s, whatever the pod allows).
    """
    flags = torchrun_arguments(min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc_per_node,
                               endpoint=endpoint, run_id=run_id, max_restarts=max_restarts, tuning=tuning,
                               local_addr=local_addr)
    flags.append("--start-method=fork")
    if grace_period_s is not None:
        flags.append(f"--shutdown-timeout={shutdown_timeout(grace_period_s)}")
    return [python, "-m", LAUNCHER_MODULE, *flags, "-m", TRAINER_MODULE, "train"]


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
                         master_port: int = BATCH_MASTER_PORT) -> list[str]:
    """The container command of an AWS Batch multi-node parallel job, ending with ``-m training
    train``; append the trainer's overrides. The node's place in the job is read from Batch's
    environment when the container starts (:func:`batch_rendezvous_arguments`)."""
    return [python, "-m", LAUNCHER_MODULE, BATCH_NODE_FLAG, f"--nproc-per-node={nproc_per_node}",
            f"--max-restarts={max_restarts}", f"--master-port={master_port}", "--start-method=fork",
            f"--shutdown-timeout={shutdown_timeout(BATCH_STOP_GRACE_S)}", "-m", TRAINER_MODULE, "train"]


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


def shutdown_timeout(grace_period_s: int) -> int:
    """Seconds the workers get to checkpoint after SIGTERM, inside the pod's grace period."""
    if grace_period_s <= SHUTDOWN_MARGIN_S:
        raise ValueError(f"a grace period of {grace_period_s} s leaves no time to checkpoint; allowed: more than "
                         f"{SHUTDOWN_MARGIN_S} s")
    return grace_period_s - SHUTDOWN_MARGIN_S


def _train_worker(*argv: str) -> None:
    """A worker's entry point, run in a process forked from the agent."""
    die_with_agent()
    from training import elastic
    from training.__main__ import main as trainer_main

    try:
        code = trainer_main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported here, then the process ends at once
        # A failed collective (a peer died) leaves gloo's threads waiting on the dead peer: the
        # interpreter's teardown would wait seconds for them, and the agent for the process
        # before it can re-form the round. The traceback is printed, and the exit is immediate.
        import traceback

        traceback.print_exc()
        code = 1
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if elastic.received_signal():
        # The agent is stopping the group (it sent the signal) and reads no result; torch's
        # process wrapper would wait for it to read one, until the agent's SIGKILL.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _trainer_config(argv: list[str]):
    """(config, None) for ``python -m training train <argv>``, or (None, its first problem), before any agent starts."""
    from training.config import load_train_config
    from typed_config import ConfigError

    if not argv or argv[0] != "train":
        return None, None
    config_path = None
    overrides = []
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "--config":
            config_path = next(rest, None)
        elif arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        elif arg == "--print-config":
            continue
        else:
            overrides.append(arg)
    try:
        return load_train_config(config_path, overrides), None
    except ConfigError as exc:
        return None, str(exc).splitlines()[0]


def _newest_checkpoint(directory: str):
    """The newest checkpoint's step in ``directory`` (None when there is none or it cannot be listed)."""
    import re

    def newest() -> int | None:
        try:
            steps = [int(m.group(1)) for name in os.listdir(directory) if (m := re.match(r"^step-(\d{9})\.pt$", name))]
        except OSError:
            return None
        return max(steps, default=None)

    return newest


def _single_node_defaults(args) -> None:
    """What torchrun's ``run()`` does before building its config (torch 2.13 torch/distributed/run.py):
    ``--standalone``, or a static rendezvous of one node without an endpoint, is a c10d rendezvous
    on localhost under a fresh id; the static backend's port defaults to 29500."""
    import uuid

    from torch.distributed.run import parse_min_max_nnodes

    single = args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None \
        and parse_min_max_nnodes(args.nnodes)[1] == 1
    if args.standalone or single:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _warm_up_trainer() -> None:
    """Before this node counts as ready to join: import the trainer, so forked workers start warm.

    torch.optim imports torch._dynamo when the first optimizer is built (torch 2.13
    torch/_compile.py, ``_disable_dynamo``): 1.7 s of a worker's 1.72 s start on this project's
    CI machine (mlp, profiled), paid again by every worker of every restart unless the agent
    has imported it before forking them.
    """
    started = time.monotonic()
    import torch._dynamo  # noqa: F401 - imported for its side effect: the modules are loaded

    import training.trainer  # noqa: F401 - likewise

    log.info("the trainer is imported (%.1f s); this node is ready to join", time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    """torchrun with the platform's rendezvous, forked workers and exit statuses (see the module docstring)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
    from torch.distributed.launcher.api import elastic_launch

    from training import agent, rendezvous

    argv = list(sys.argv[1:] if argv is None else argv)
    if BATCH_NODE_FLAG in argv:
        try:
            position = argv.index(BATCH_NODE_FLAG)
            argv[position:position + 1] = batch_rendezvous_arguments(dict(os.environ))
        except BatchEnvironmentError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return EXIT_CONFIG
    args = torchrun.parse_args(argv)
    trainer_config = None
    if args.module and args.training_script == TRAINER_MODULE:
        trainer_config, problem = _trainer_config(args.training_script_args)
        if problem:
            print(f"config error: {problem}", file=sys.stderr)
            return EXIT_CONFIG
    newest_checkpoint = _newest_checkpoint(trainer_config.checkpoint.dir) if trainer_config else lambda: None
    agent.install(newest_checkpoint)
    checkpoint_at_start = newest_checkpoint()
    os.environ.update(LAUNCH_ENVIRONMENT)
    if trainer_config is not None:
        # The packaged trainer reports its progress (the rendezvous counts training time from it)
        # and can change rounds without a restart (training/agent.py, _regroup).
        agent_dir = tempfile.mkdtemp(prefix="platform-agent-")
        os.environ[PROGRESS_FILE_ENV] = os.path.join(agent_dir, "progress")
        os.environ[CONTROL_DIR_ENV] = agent_dir
    rendezvous.register(warm_up=_warm_up_trainer if trainer_config is not None else None)
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    _single_node_defaults(args)
    config, entrypoint, entry_args = torchrun.config_from_args(args)
    if args.module and args.training_script == TRAINER_MODULE and config.start_method == "fork":
        entrypoint, entry_args = _train_worker, list(args.training_script_args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The workers' budget between SIGTERM and SIGKILL; the trainer checks its checkpoints against it.
    os.environ[STOP_BUDGET_ENV] = str(config.shutdown_timeout or 30)
    try:
        elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except SignalException as exc:
        log.warning("stopped by %s; the workers checkpointed", exc.sigval.name)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        final = sorted({failure.exitcode for failure in exc.failures.values()} & set(FINAL_EXITS))
        if final:
            return final[0]  # the worker said why, in one line, above
        newest = newest_checkpoint()
        if newest is None or newest == checkpoint_at_start:
            # Two counters, two jobs: Volcano's maxRetry is out of reach (k8s_charts/job_charts.py),
            # so a crash loop is ended here, where progress is known.
            log.error("workers failed and --max-restarts is spent with no checkpoint since this agent started "
                      "(newest: %s): ending the job, a fresh incarnation would fail the same way", newest)
            return EXIT_CRASH_LOOP
        log.error("workers failed and --max-restarts is spent after progress (checkpoint %s, %s at the start); "
                  "asking for a fresh incarnation of the job", newest, checkpoint_at_start)
        return EXIT_RESTART_JOB
    except RendezvousClosedError:
        # Only a job's success closes its round: this node came after the end.
        log.info("the job finished before this node could join; nothing to do")
        return 0
    except Exception as exc:  # noqa: BLE001 - any other end of the agent: this incarnation is over
        log.error("the agent ended with %s: %s; asking for a fresh incarnation of the job",
                  type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", exc_info=exc)
        return EXIT_RESTART_JOB
    return 0


if __name__ == "__main__":
    sys.exit(main())
