"""``python -m training.launcher``: the platform's launcher, which every training pod runs.

Its command line comes from :func:`training.contract.launch_command` (the charts, the local
cluster and the tests build commands only with it): the platform's launcher, torchrun's flags,
and the program: ``-m training train`` with the trainer's overrides, or a job's own program
(``-m <module> <args>`` or ``<script> <args>``, docs/job-spec.md, "Your own torchrun program"), which gets
torchrun's subprocess workers, the same rendezvous, exit statuses and stop budget, and has its
progress counted by the numbered entries of ``$PLATFORM_CHECKPOINT_DIR``.

``python -m training.launcher`` is torchrun with five platform decisions (each measured with
real agents and a real etcd under torch 2.8, 2.13 and 2.14; see docs/elasticity-and-checkpoints.md):

- the ``platform-etcd`` rendezvous (:mod:`training.launcher.rendezvous`) on etcd's v3 API: leases for
  liveness, growth admitted in batches, shrink without a last call, etcd outages up to
  ``outage_tolerance`` waited out, and only the job's success closes a round;
- sub-second keep-alives, which torchrun's own parser cannot take;
- warm workers for the packaged trainer: forked by a server that imported torch and the trainer
  before the node counted as waiting, never by the agent, so they can use CUDA (:mod:`training.launcher.workers`);
- only what every supported torch has of torch's agent, checked at start (:mod:`training.launcher.compat`),
  and its own ``--shutdown-timeout``, which torchrun's parser has only from 2.13;
- exit statuses the job controller acts on (:data:`EXIT_CONFIG`, :data:`EXIT_RESTART_JOB`); a failure of
  the launcher itself, or before any progress, ends the job in one line instead of restarting it.

torch is imported only by :func:`main`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import tempfile

from training.contract import (
    AGENT_PID_ENV, BATCH_NODE_FLAG, CHECKPOINT_DIR_ENV, CONTROL_DIR_ENV, EXIT_CONFIG, EXIT_CRASH_LOOP,
    EXIT_REPLACE_NODE, EXIT_RESTART_JOB, FINAL_EXITS, LAUNCH_ENVIRONMENT, MIN_NODES_ENV, PROGRESS_FILE_ENV,
    RESTART_MARKER_ENV, SLURM_NODE_FLAG, STOP_BUDGET_ENV, TRAINER_MODULE, BatchEnvironmentError,
    SlurmEnvironmentError, batch_rendezvous_arguments, checkpoint_step, program_checkpoint_step,
    slurm_rendezvous_arguments,
)

log = logging.getLogger("training.launcher")
SHUTDOWN_TIMEOUT_FLAG = "--shutdown-timeout"
SHUTDOWN_TIMEOUT_SPELLINGS = (SHUTDOWN_TIMEOUT_FLAG, "--shutdown_timeout")  # torchrun takes both (run.py:690-691 @2.13)
# torchrun start methods that mean the packaged trainer's warm workers: fork (commands rendered by
# earlier releases) is served by the forkserver too, since a forked worker cannot use CUDA.
WARM_START_METHODS = ("fork", "forkserver")


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


def _own_flags(argv: list[str], takes_value: set[str]) -> tuple[list[str], float | None, str | None]:
    """(argv without the launcher's own flags, --shutdown-timeout's value, the first problem).

    ``--shutdown-timeout`` is the launcher's: torchrun has it only from torch 2.13 (run.py:689 at
    2.13; absent at 2.8), and its agent applies it only to a stop by a signal, not to a restart.
    Only the launcher's part of the command is read: it ends where the program starts (the first
    word that is not an option or an option's value; ``takes_value``: torchrun's options with a value).
    """
    rest, budget = [], None
    position = 0
    while position < len(argv):
        arg = argv[position]
        position += 1
        if arg.split("=", 1)[0] in SHUTDOWN_TIMEOUT_SPELLINGS:
            if "=" in arg:
                raw = arg.split("=", 1)[1]
            else:
                raw = argv[position] if position < len(argv) else ""
                position += 1
            try:
                budget = float(raw)
            except ValueError:
                budget = -1.0
            if not (budget >= 0 and math.isfinite(budget)):
                return argv, None, f"{SHUTDOWN_TIMEOUT_FLAG}: got {raw!r}; allowed: seconds, 0 or more"
            continue
        rest.append(arg)
        if not arg.startswith("-") or arg == "--":
            rest += argv[position:]  # the program and its arguments: never the launcher's
            break
        if "=" not in arg and arg in takes_value and position < len(argv):
            rest.append(argv[position])
            position += 1
    return rest, budget, None


def _options_with_values(parser) -> set[str]:
    return {option for action in parser._actions if action.nargs != 0 for option in action.option_strings}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """torchrun with the platform's rendezvous, warm workers and exit statuses (see the module docstring)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from training.launcher import compat

    argv = list(sys.argv[1:] if argv is None else argv)
    problem = compat.problem()  # before anything of torch's agent is imported: one line, not a traceback
    if problem:
        print(f"config error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    from torch.distributed import run as torchrun

    argv, stop_budget_s, problem = _own_flags(argv, _options_with_values(torchrun.get_args_parser()))
    if problem:
        print(f"config error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
    from torch.distributed.launcher.api import elastic_launch

    from training.launcher import agent, rendezvous, workers

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
    stop_budget_s = agent.DEFAULT_STOP_BUDGET_S if stop_budget_s is None else stop_budget_s
    stops = agent.StopRecord()
    agent.install(newest_checkpoint, stop_budget_s=stop_budget_s, stops=stops)
    checkpoint_at_start = newest_checkpoint()
    os.environ.update(LAUNCH_ENVIRONMENT)
    if trainer_config is not None:
        # The packaged trainer reports its progress (the rendezvous counts training time from it)
        # and can change rounds without a restart (training/launcher/agent.py, _regroup).
        agent_dir = tempfile.mkdtemp(prefix="platform-agent-")
        os.environ[PROGRESS_FILE_ENV] = os.path.join(agent_dir, "progress")
        os.environ[CONTROL_DIR_ENV] = agent_dir
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    os.environ[MIN_NODES_ENV] = str(torchrun.parse_min_max_nnodes(args.nnodes)[0])  # a replaced node keeps it
    _single_node_defaults(args)
    config, entrypoint, entry_args = torchrun.config_from_args(args)
    warm = packaged and config.start_method in WARM_START_METHODS
    if warm:
        # The packaged trainer's workers come from a forkserver that has imported it (workers.py): warm
        # like forked ones, and free to use CUDA or Neuron whatever the agent did (it counted the GPUs).
        config.start_method = workers.START_METHOD
        entrypoint, entry_args = workers.train_worker, list(args.training_script_args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The workers' budget between SIGTERM and SIGKILL; the trainer checks its checkpoints against it.
    os.environ[STOP_BUDGET_ENV] = str(int(stop_budget_s) if float(stop_budget_s).is_integer() else stop_budget_s)
    # Last, once the environment is final (the workers' is the server's): the node counts as ready to
    # join only when its warm-up is done. Another rendezvous (Batch's and Slurm's static one) has no
    # waiting to order: the server starts now.
    rendezvous.register(warm_up=_start_warm_workers if warm else None)
    try:
        if warm and config.rdzv_backend != rendezvous.BACKEND_NAME:
            _start_warm_workers()
        elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except SignalException as exc:
        name = signal.Signals(int(exc.sigval)).name
        stop = stops.last()
        if stop is not None and stop.checkpointed:
            log.warning("stopped by %s; the workers wrote their stop checkpoint (step %s)", name, stop.after)
        else:
            log.warning("stopped by %s; no new checkpoint was written (newest: %s)", name,
                        stop.after if stop is not None else newest_checkpoint())
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()}
        if EXIT_REPLACE_NODE in codes:
            return EXIT_REPLACE_NODE  # the pod ends; the controller starts another, off this node
        final = sorted(codes & set(FINAL_EXITS))
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
    except compat.TorchIncompatible as exc:
        print(f"config error: {exc}; allowed: torch {compat.supported()} (training/launcher/compat.py)",
              file=sys.stderr)
        return EXIT_CONFIG
    except Exception as exc:  # noqa: BLE001 - any other end of the agent: _agent_failed says what follows
        return _agent_failed(exc, newest_checkpoint)
    return 0


def _start_warm_workers() -> None:
    from training.launcher import workers

    seconds = workers.start_server(meanwhile=_import_dynamo)
    log.info("the trainer is imported in this node's worker server (%.1f s); this node is ready to join", seconds)


def _import_dynamo() -> None:
    """torch's log formatter imports torch._dynamo the first time the agent logs a worker's failure
    (torch 2.13 torch/_logging/_internal.py, ``format``): 2 s on this project's CI machine, added to
    every restart's first one unless imported here, while the worker server imports the trainer."""
    import torch._dynamo  # noqa: F401 - imported for its side effect


# Errors of the launcher's own code, or of a torch it cannot run on: a new incarnation would meet them again.
INTERNAL_ERRORS = (AttributeError, TypeError, NameError, ImportError, AssertionError, NotImplementedError)


def _agent_failed(exc: Exception, newest_checkpoint) -> int:
    """The agent ended with an error of its own (not its workers'). A bug or an incompatible torch ends the
    job (78); so does any other error of a job that never wrote a checkpoint (77: nothing was ever trained,
    a fresh incarnation would start from nothing and most likely fail the same way). Otherwise the error is
    the rendezvous', the store's or the network's, which a new start can clear: a fresh incarnation (79)."""
    import torch

    from training.launcher.workers import WorkerServerError

    newest = newest_checkpoint()
    log.error("the agent failed", exc_info=exc)
    if isinstance(exc, (*INTERNAL_ERRORS, WorkerServerError)):
        print(f"config error: the launcher failed on torch {torch.__version__}: {_first_line(exc)}; ending the "
              "job, a restart would fail the same way (please report it with the lines above)", file=sys.stderr)
        return EXIT_CONFIG
    if newest is None:
        print(f"the launcher failed before the job wrote any checkpoint ({_first_line(exc)}): ending the job, a "
              "fresh incarnation would start from nothing again", file=sys.stderr)
        return EXIT_CRASH_LOOP
    log.error("the agent ended with %s; the job has trained (checkpoint %s): asking for a fresh incarnation",
              _first_line(exc), newest)
    return _fresh_incarnation()
