"""``trainctl``: preflight an account, stage data, render / submit / watch / cancel training jobs."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from config import ConfigError
from trainctl.backends import BACKENDS, DEFAULT_BACKEND, JOB_COMMANDS
from trainctl.config_source import CONFIG_ENV, ConfigSource
from training.contract import checkpoint_step

WATCH_INTERVAL_S = 10
# Commands that act on an AWS account, and those that act on the jobs of a cluster.
ACCOUNT_COMMANDS = ("preflight", "stage-data", "checkpoints")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("eks-elastic-training-platform")
    except PackageNotFoundError:
        return "unknown (not installed; run `make synth`)"


def _global_options(after_the_command: bool) -> argparse.ArgumentParser:
    """--config, --profile and --context, accepted before or after the subcommand. After it,
    an option left out must not overwrite what was given before it (SUPPRESS: no default)."""
    defaults = {"config": None, "profile": None, "context": None}
    if after_the_command:
        defaults = dict.fromkeys(defaults, argparse.SUPPRESS)
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--config", default=defaults["config"],
                         help=f"platform config (default: ${CONFIG_ENV}, else the one `trainctl use-config` saved)")
    options.add_argument("--profile", default=defaults["profile"],
                         help="AWS profile (default: the usual credential chain)")
    options.add_argument("--context", default=defaults["context"],
                         help="use this kubeconfig context instead of an EKS token")
    return options


def _duration_s(text: str) -> int:
    """``90s``, ``10m``, ``2h`` or ``1d`` as seconds (argparse type for --since)."""
    match = re.fullmatch(r"(\d+)([smhd])", text)
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: a positive duration such as 90s, 10m, 2h or 1d")
    return int(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


class _OneLineParser(argparse.ArgumentParser):
    """A command-line mistake is one line, like every other trainctl error (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="trainctl", description=__doc__, parents=[_global_options(False)])
    parser.add_argument("--version", action="version", version=f"trainctl {_version()}")
    globals_after = [_global_options(True)]
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=text, description=text, parents=globals_after)

    use = commands.add_parser("use-config", help="remember a platform config for later commands (per user)",
                              description="check PATH and save it as this user's default platform config, "
                                          f"used when neither --config nor ${CONFIG_ENV} is given")
    use.add_argument("path", type=Path)
    command("preflight", "check the account can run the config (read-only)")
    stage = command("stage-data", "upload a local dataset folder to the imported prefix, in parallel and resumably")
    stage.add_argument("source", type=Path)
    stage.add_argument("--under", default="", help="sub-path below the data prefix, e.g. imagenet/train")
    stage.add_argument("--concurrency", type=int, default=64, help="files uploaded at once (default 64)")
    for name, text in (("render", "print the job's manifests"), ("submit", "apply the job to the cluster")):
        sub = command(name, text)
        sub.add_argument("job", type=Path)
        sub.add_argument("--nccl-check", action="store_true", help="the job's EFA/NCCL check instead")
        if name == "submit":
            sub.add_argument("--replace", action="store_true",
                             help="delete a job of the same name first and wait until it is gone")
            sub.add_argument("--dry-run", nargs="?", const="client", choices=("client", "server"),
                             help="change nothing: client checks and renders here; server also asks the API server "
                                  "to validate and admit the job without storing it (kubectl's --dry-run)")
            sub.add_argument("--wait", action="store_true", help="wait until the job ends; exit 0 if it completed")
            sub.add_argument("--follow", action="store_true", help="then follow rank 0's log until the job ends")
            sub.add_argument("--interval", type=float, default=WATCH_INTERVAL_S, help=argparse.SUPPRESS)
    status = command("status", "phase, pods, why it waits, rendezvous, last metrics, newest checkpoint")
    status.add_argument("name")
    status.add_argument("--watch", action="store_true", help=f"refresh every {WATCH_INTERVAL_S} s until the job ends")
    status.add_argument("--interval", type=float, default=WATCH_INTERVAL_S, help=argparse.SUPPRESS)
    cancel = command("cancel", "delete a job and its pods; checkpoints are kept")
    cancel.add_argument("name", nargs="?")
    cancel.add_argument("--all", action="store_true", help="every job in the jobs namespace (asks first)")
    cancel.add_argument("--yes", action="store_true", help="do not ask (scripts)")
    logs = command("logs", "a worker's log")
    logs.add_argument("name")
    which = logs.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, help="the pod whose workers hold this global rank now (default 0)")
    which.add_argument("--pod", type=int, metavar="INDEX", help="the pod <job>-worker-INDEX, whatever its rank")
    which.add_argument("--all", action="store_true", help="every worker's log, each line prefixed with its pod")
    logs.add_argument("--follow", "-f", action="store_true")
    logs.add_argument("--previous", action="store_true", help="the container's previous run (after a restart)")
    logs.add_argument("--since", type=_duration_s, help="only the last 90s, 10m, 2h, 1d")
    checkpoints = command("checkpoints", "a job's checkpoints, as exported to S3")
    checkpoints.add_argument("name")
    command("list", "the jobs in the jobs namespace")
    command("nodes", "the accelerated nodes: node check verdict, readiness, scheduling, health conditions")
    for name in ("status", "list", "nodes"):
        commands.choices[name].add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text",
                                            help="text for people (default), json or yaml for scripts")
    for name in JOB_COMMANDS:
        commands.choices[name].add_argument(
            "--backend", choices=tuple(BACKENDS), default=DEFAULT_BACKEND,
            help="eks (Volcano on the cluster, elastic), batch (AWS Batch multi-node parallel, fixed size), "
                 "slurm (the ParallelCluster of the slurm stack, requeued on a lost node) or "
                 "local (this machine, CPU, a real etcd and agents: trainctl.backends.local)")
        commands.choices[name].add_argument("--workdir", type=Path,
                                            help="--backend local: its folder (default ~/.cache/trainctl-local)")
        commands.choices[name].add_argument(
            "--on-head-node", action="store_true",
            help="--backend slurm: run Slurm's commands here (you are on the head node) instead of through SSM")
    slurm = commands.choices["submit"].add_argument_group("--backend slurm")
    slurm.add_argument("--python", metavar="PATH",
                       help="run the job with this Python on the nodes (the platform's package installed in it, e.g. "
                            "on /fsx) instead of its image under Pyxis")
    local = commands.choices["submit"].add_argument_group("--backend local")
    local.add_argument("--nodes", type=int, help="agents to start (default: max_nodes, as many as fit this machine)")
    local.add_argument("--nproc-per-node", type=int, help="CPU workers per agent (default 1)")
    completion = commands.add_parser("completion", help="print a shell completion script",
                                     description="eval \"$(trainctl completion bash)\" in ~/.bashrc, or zsh / tcsh")
    completion.add_argument("shell", choices=("bash", "zsh", "tcsh"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "completion":  # needs no config
        import shtab

        print(shtab.complete(parser, shell=args.shell))
        return 0
    source: ConfigSource | None = None
    try:
        from config import load_config
        from trainctl.config_source import find_config, use_config

        if args.command == "use-config":
            load_config(args.path, missing_hint="pass the path of an existing platform config")
            print(f"later trainctl commands use {args.path.resolve()} unless --config or ${CONFIG_ENV} is given "
                  f"(saved in {use_config(args.path)})")
            return 0
        source = find_config(args.config)
        config = load_config(source.path, missing_hint=f"the config comes from {source.origin}; pass an existing "
                             "platform config with --config PATH")
        return run(parser, args, config, source)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"config error: {line}{_naming(source, exc.source)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # user mistakes become one line; real faults keep their traceback
        from k8s_charts.node_runtime import NodeRuntimeMissing
        from trainctl.errors import UserError, from_aws

        if isinstance(exc, NodeRuntimeMissing):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        error = exc if isinstance(exc, UserError) else from_aws(exc, getattr(args, "region", ""))
        if error is None:
            raise
        print(f"error: {error}{_naming(source)}", file=sys.stderr)
        return 2


def _naming(source: ConfigSource | None, about: str | None = None) -> str:
    """Every error names the config it was judged against (unless the line is about that file)."""
    if source is None or about == source.path:
        return ""
    return f" [config {source}]"


def _connection(args, config):
    from trainctl.backends import Connection

    return Connection(config, profile=args.profile, context=args.context,
                      on_head_node=getattr(args, "on_head_node", False), workdir=getattr(args, "workdir", None))


def header(args, config, source: ConfigSource) -> str:
    """One line on stderr, before a command acts: which config, and what it acts on."""
    from trainctl.backends import load

    line = f"trainctl: config {source}"
    if args.command in ACCOUNT_COMMANDS:
        account = f"AWS account {config.account}" if config.account else "the AWS account of your credentials"
        return f"{line}; {account}, {config.region}"
    # render and nodes are the cluster's: the eks backend's
    return f"{line}; {load(getattr(args, 'backend', DEFAULT_BACKEND)).where(_connection(args, config), args.command)}"


def _session(args):
    from trainctl.backends import aws_session

    return aws_session(args.profile)


# Options every job command takes whatever the backend: not the backend's to honour or refuse.
_COMMON_OPTIONS = {"config", "profile", "context", "backend", "help", "interval"}


def given_options(parser: argparse.ArgumentParser, args) -> list[tuple[str, str]]:
    """Each option the user gave the command, as (its spelling in Backend.options, as typed)."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    given = []
    for action in commands.choices[args.command]._actions:
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or action.dest in _COMMON_OPTIONS or value == action.default:
            continue
        if action.dest == "output":
            given.append(("-o", f"-o {value}"))
        elif action.dest == "dry_run":
            given.append(("--dry-run=server",) * 2 if value == "server" else ("--dry-run",) * 2)
        else:
            flag = max(action.option_strings, key=len)
            given.append((flag, flag))
    return given


def _check_combinations(args, backend) -> None:
    """What no backend can do: options that contradict each other."""
    from trainctl.errors import UserError, check_name

    command = args.command
    if command == "cancel" and args.all == (args.name is not None):
        allowed = "`trainctl cancel NAME`" + (", or `trainctl cancel --all` for every job"
                                               if "--all" in backend.options["cancel"] else "")
        raise UserError(f"cancel: got {'both a name and --all' if args.all else 'neither a name nor --all'}",
                        f"allowed: {allowed}")
    if command == "logs" and args.all and args.follow:
        raise UserError("logs: got --all with --follow", "allowed: --follow with one --rank or --pod")
    if command == "submit" and args.dry_run and (args.follow or args.wait):
        raise UserError(f"--dry-run: got {'--follow' if args.follow else '--wait'}",
                        "allowed with --dry-run: --replace and --nccl-check (nothing runs to wait for)")
    if getattr(args, "name", None) is not None:
        check_name("job name", args.name)


def run(parser, args, config, source: ConfigSource) -> int:
    args.region = config.region
    print(header(args, config, source), file=sys.stderr, flush=True)
    if args.command == "preflight":
        from trainctl.preflight import format_table, run_preflight

        checks = run_preflight(config, _session(args))
        print(format_table(checks))
        return 0 if all(c.passed for c in checks) else 1
    if args.command == "stage-data":
        return stage(args, config)
    if args.command == "checkpoints":
        return list_checkpoints(args, config)
    if args.command == "nodes":
        return nodes(args, config)
    from config.job_spec import load_job_spec

    if args.command == "render":
        from trainctl.backends import load

        # what `submit` would apply to the cluster: the eks backend's manifests
        print(load("eks").render(config, load_job_spec(args.job, config), args.nccl_check), end="")
        return 0
    return run_job_command(parser, args, config)


def run_job_command(parser, args, config) -> int:
    """submit, status, logs, cancel and list, the same way on every backend (trainctl.backends)."""
    from trainctl.backends import LogOptions, SubmitOptions, load, refuse_unsupported

    backend_class = load(args.backend)
    refuse_unsupported(backend_class, args.command, given_options(parser, args))
    _check_combinations(args, backend_class)
    backend = backend_class(_connection(args, config))
    if args.command == "submit":
        from config.job_spec import load_job_spec

        submitted = backend.submit(load_job_spec(args.job, config), SubmitOptions(
            replace=args.replace, dry_run=args.dry_run, nccl_check=args.nccl_check, python=args.python,
            nodes=args.nodes, nproc_per_node=args.nproc_per_node))
        if submitted.exit_code is not None:  # it ran in the foreground, to its end
            return submitted.exit_code
        if submitted.name is None:
            return 0
        if args.follow:
            return backend.follow(submitted.name, args.interval)
        if args.wait:
            return _wait_for_end(backend, submitted.name, args.interval)
        return 0
    if args.command == "status":
        while True:
            report = backend.status(args.name)
            if args.watch and sys.stdout.isatty() and args.output == "text":
                print("\033[H\033[J", end="")  # clear the screen, as `watch` does
            print(report.format() if args.output == "text" else _dump(report.as_dict(), args.output), flush=True)
            if not args.watch or report.finished:
                return 0
            time.sleep(args.interval)
            if not sys.stdout.isatty():
                print()
    if args.command == "list":
        rows = backend.jobs()
        if args.output != "text":
            print(_dump(rows, args.output))
        else:
            print("\n".join(backend.list_line(row) for row in rows) if rows else backend.nothing_listed())
        return 0
    if args.command == "logs":
        backend.logs(args.name, LogOptions(rank=args.rank, pod=args.pod, all=args.all, follow=args.follow,
                                           previous=args.previous, since_s=args.since))
        return 0
    if args.all:  # cancel
        return backend.cancel_all(args.yes)
    print(backend.cancel(args.name))
    return 0


def _wait_for_end(backend, name: str, interval_s: float) -> int:
    """Until the job ends, saying each new state (each backend's own: EKS phases, Batch and Slurm job
    states); 0 if it succeeded."""
    from trainctl.backends import say

    said = None
    while True:
        report = backend.status(name)
        if report.summary() != said:
            said = report.summary()
            say(said)
        if report.finished:
            return 0 if report.succeeded else 1
        time.sleep(interval_s)


def _dump(data, output: str) -> str:
    """``-o json`` / ``-o yaml``: the same fields as the text, for scripts."""
    import json

    import yaml

    return json.dumps(data, indent=2, default=str) if output == "json" else yaml.safe_dump(data, sort_keys=False).rstrip()


def stage(args, config) -> int:
    from tqdm import tqdm

    from trainctl.stage import stage_data, under_prefix

    under = under_prefix(args.under)  # checked before any AWS call
    if args.concurrency < 1 or args.concurrency > 512:
        from trainctl.errors import UserError

        raise UserError(f"--concurrency: got {args.concurrency}", "allowed: 1 to 512")
    session = _session(args)
    bucket, prefix = stack_outputs(session, config, "storage", "DataBucketName", "DataPrefix")
    s3 = session.client("s3", region_name=config.region, config=_s3_pool(args.concurrency))
    result = stage_data(args.source, s3, bucket, prefix + under, progress=tqdm, concurrency=args.concurrency)
    print(f"uploaded {result.uploaded} files ({result.bytes_uploaded} bytes), skipped {result.skipped} "
          f"already there; the file system imports them under /fsx{config.fsx.data_path}/{under}")
    return 0


def _s3_pool(concurrency: int):
    from botocore.config import Config

    # One connection per concurrent upload; botocore's default pool of 10 would serialize the rest.
    return Config(max_pool_connections=concurrency, retries={"mode": "adaptive", "max_attempts": 10})


def list_checkpoints(args, config) -> int:
    from trainctl.errors import check_name

    name = check_name("job name", args.name)
    session = _session(args)
    bucket, prefix = stack_outputs(session, config, "storage", "DataBucketName", "CheckpointPrefix")
    s3 = session.client("s3", region_name=config.region)
    found = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}{name}/"):
        found += [obj for obj in page.get("Contents", []) if checkpoint_step(obj["Key"]) is not None]
    if not found:
        print(f"no checkpoints of {name} in s3://{bucket}/{prefix}{name}/ (the file system exports them within "
              "minutes of each save)")
        return 0
    for obj in sorted(found, key=lambda o: o["Key"]):
        print(f"s3://{bucket}/{obj['Key']}  {obj['Size'] / 2**20:,.1f} MiB  {obj['LastModified']:%Y-%m-%d %H:%M:%S %Z}")
    return 0


def nodes(args, config) -> int:
    from kubernetes import client

    from trainctl.errors import from_kube
    from trainctl.kube import api_client
    from trainctl.nodes import accelerated_nodes, as_dicts, format_rows

    api = api_client(_session(args), config.name_prefix, config.region, args.context)
    try:
        rows = accelerated_nodes(client.CoreV1Api(api))
    except Exception as exc:  # API and transport errors users cause become one line
        error = from_kube(exc, api.configuration.host)
        if error is None:
            raise
        raise error from None
    print(format_rows(rows) if args.output == "text" else _dump(as_dicts(rows), args.output))
    return 0


def stack_outputs(session, config, stack: str, *keys: str) -> list[str]:
    from trainctl.errors import UserError

    name = config.stack_name(stack)
    cloudformation = session.client("cloudformation", region_name=config.region)
    try:
        outputs = cloudformation.describe_stacks(StackName=name)["Stacks"][0].get("Outputs", [])
    except cloudformation.exceptions.ClientError as exc:
        if "does not exist" in str(exc):
            raise UserError(f"stack {name} not found in {config.region}", "deploy the platform first "
                            "(npx cdk deploy --all) or check name_prefix and region") from None
        raise
    found = {o["OutputKey"]: o["OutputValue"] for o in outputs}
    return [found[key] for key in keys]


if __name__ == "__main__":
    sys.exit(main())
