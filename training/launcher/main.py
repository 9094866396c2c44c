"""``python -m training.launcher``: the platform's launcher, which every training pod runs.

Its command line comes from :func:`training.contract.launch_command` (the charts, the local
cluster and the tests build commands only with it): the platform's launcher, torchrun's flags,
and the program: ``-m training train`` with the trainer's overrides, or a job's own program
(``-m <module> <args>`` or ``<script> <args>``, docs/job-spec.md, "Your own torchrun program"), which gets
torchrun's subprocess workers, the same rendezvous, exit statuses and stop budget, and has its
progress counted by the numbered entries of ``$PLATFORM_CHECKPOINT_DIR``.

``python -m training.launcher`` is torchrun with four platform decisions (each measured with
torch 2.13, real agents and a real etcd; see docs/elasticity-and-checkpoints.md):

- the ``platform-etcd`` rendezvous (:mod:`training.launcher.rendezvous`) on etcd's v3 API: leases for
  liveness, growth admitted in batches, shrink without a last call, etcd outages up to
  ``outage_tolerance`` waited out, and only the job's success closes a round;
- sub-second keep-alives, which torchrun's own parser cannot take;
- workers forked from the agent, which has imported torch and the trainer already (seconds
  less per restart, and a node joining a running job is warm before it counts as waiting;
  the packaged trainer only);
- exit statuses the job controller acts on (:data:`EXIT_CONFIG`, :data:`EXIT_RESTART_JOB`).

torch is imported only by :func:`main`.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time

from training.contract import (
    AGENT_PID_ENV, BATCH_NODE_FLAG, CHECKPOINT_DIR_ENV, CONTROL_DIR_ENV, EXIT_CONFIG, EXIT_CRASH_LOOP,
    EXIT_RESTART_JOB, FINAL_EXITS, LAUNCH_ENVIRONMENT, PROGRESS_FILE_ENV, RESTART_MARKER_ENV, SLURM_NODE_FLAG,
    STOP_BUDGET_ENV, TRAINER_MODULE, BatchEnvironmentError, SlurmEnvironmentError, batch_rendezvous_arguments,
    checkpoint_step, program_checkpoint_step, slurm_rendezvous_arguments,
)

log = logging.getLogger("training.launcher")


def _train_worker(*argv: str) -> None:
    """A worker's entry point, run in a process forked from the agent."""
    from training.loop.worker_guard import die_with_agent

    die_with_agent()
    from training.loop import elastic
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


def _newest_checkpoint(directory: str, step_of=checkpoint_step):
    """The newest checkpoint's step in ``directory`` (None when there is none or it cannot be listed);
    ``step_of`` reads an entry's name: the packaged trainer's files, or a job's own program's entries."""
    def newest() -> int | None:
        try:
            steps = [step for name in os.listdir(directory) if (step := step_of(name)) is not None]
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
    import torch._dynamo  # noqa: F401 - imported for its side effect: the modules are loaded before the fork

    import training.loop.trainer  # noqa: F401 - likewise: imported for its side effect, before the fork

    log.info("the trainer is imported (%.1f s); this node is ready to join", time.monotonic() - started)


def _fresh_incarnation() -> int:
    """EXIT_RESTART_JOB, said also in the file $PLATFORM_RESTART_MARKER names when the scheduler loses a
    node's own status (Slurm: see RESTART_MARKER_ENV)."""
    marker = os.environ.get(RESTART_MARKER_ENV)
    if marker:
        try:
            with open(marker, "a"):
                pass
        except OSError as exc:
            log.error("could not write %s (%s): the job may end instead of starting afresh", marker, exc)
    return EXIT_RESTART_JOB


def main(argv: list[str] | None = None) -> int:
    """torchrun with the platform's rendezvous, forked workers and exit statuses (see the module docstring)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
    from torch.distributed.launcher.api import elastic_launch

    from training.launcher import agent, rendezvous

    argv = list(sys.argv[1:] if argv is None else argv)
    # A scheduler's fixed allocation (AWS Batch, Slurm): the node's place comes from the scheduler's variables.
    for flag, place in ((BATCH_NODE_FLAG, batch_rendezvous_arguments), (SLURM_NODE_FLAG, slurm_rendezvous_arguments)):
        if flag in argv:
            try:
                position = argv.index(flag)
                argv[position:position + 1] = place(dict(os.environ))
            except (BatchEnvironmentError, SlurmEnvironmentError) as exc:
                print(f"config error: {exc}", file=sys.stderr)
                return EXIT_CONFIG
    args = torchrun.parse_args(argv)
    trainer_config = None
    packaged = args.module and args.training_script == TRAINER_MODULE
    if packaged:
        trainer_config, problem = _trainer_config(args.training_script_args)
        if problem:
            print(f"config error: {problem}", file=sys.stderr)
            return EXIT_CONFIG
    if trainer_config is not None:
        newest_checkpoint = _newest_checkpoint(trainer_config.checkpoint.dir)
    elif not packaged and os.environ.get(CHECKPOINT_DIR_ENV):
        # A job's own program: a newer numbered entry in its checkpoint folder is its progress.
        newest_checkpoint = _newest_checkpoint(os.environ[CHECKPOINT_DIR_ENV], program_checkpoint_step)
    else:
        newest_checkpoint = lambda: None  # noqa: E731 - no progress to count: every failure counts
    agent.install(newest_checkpoint)
    checkpoint_at_start = newest_checkpoint()
    os.environ.update(LAUNCH_ENVIRONMENT)
    if trainer_config is not None:
        # The packaged trainer reports its progress (the rendezvous counts training time from it)
        # and can change rounds without a restart (training/launcher/agent.py, _regroup).
        agent_dir = tempfile.mkdtemp(prefix="platform-agent-")
        os.environ[PROGRESS_FILE_ENV] = os.path.join(agent_dir, "progress")
        os.environ[CONTROL_DIR_ENV] = agent_dir
    rendezvous.register(warm_up=_warm_up_trainer if trainer_config is not None else None)
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    _single_node_defaults(args)
    config, entrypoint, entry_args = torchrun.config_from_args(args)
    if packaged and config.start_method == "fork":
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
        return _fresh_incarnation()
    except RendezvousClosedError:
        # Only a job's success closes its round: this node came after the end.
        log.info("the job finished before this node could join; nothing to do")
        return 0
    except Exception as exc:  # any other end of the agent: this incarnation is over
        log.error("the agent ended with %s: %s; asking for a fresh incarnation of the job",
                  type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", exc_info=exc)
        return _fresh_incarnation()
    return 0

