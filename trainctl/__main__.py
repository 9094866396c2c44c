"""``trainctl``: preflight an account, stage data, render / submit / watch / cancel training jobs."""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

from config import ConfigError
from trainctl.config_source import CONFIG_ENV, ConfigSource
from training.contract import checkpoint_step

WATCH_INTERVAL_S = 10
# Commands that act on an AWS account, and those that act on the jobs of a cluster.
ACCOUNT_COMMANDS = ("preflight", "stage-data", "checkpoints")
JOB_COMMANDS = ("submit", "status", "cancel", "logs", "list")


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
            "--backend", choices=("eks", "batch", "slurm", "local"), default="eks",
            help="eks (Volcano on the cluster, elastic), batch (AWS Batch multi-node parallel, fixed size), "
                 "slurm (the ParallelCluster of the slurm stack, requeued on a lost node) or "
                 "local (this machine, CPU, a real etcd and agents: trainctl.local)")
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
        print(header(args, config, source), file=sys.stderr, flush=True)
        return run(args, config)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"config error: {line}{_naming(source, exc.source)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # user mistakes become one line; real faults keep their traceback
        from k8s_charts.node import NodeRuntimeMissing
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


def header(args, config, source: ConfigSource) -> str:
    """One line on stderr, before a command acts: which config, and what it acts on."""
    line = f"trainctl: config {source}"
    backend = getattr(args, "backend", "eks")
    if args.command in ACCOUNT_COMMANDS:
        account = f"AWS account {config.account}" if config.account else "the AWS account of your credentials"
        return f"{line}; {account}, {config.region}"
    if backend == "batch":
        return f"{line}; AWS Batch in {config.region}"
    if backend == "local":
        return f"{line}; this machine (--backend local, CPU)"
    if backend == "slurm":
        how = "this machine as its head node" if args.on_head_node else "its head node through SSM"
        return f"{line}; Slurm cluster {config.slurm_cluster_name if config.slurm else '(none)'} in {config.region}, {how}"
    cluster = f"kubeconfig context {args.context}" if args.context else (
        f"cluster {config.name_prefix} in {config.region}")
    if args.command == "nodes":
        return f"{line}; {cluster}"
    verb = "for " if args.command == "render" else ""
    return f"{line}; {verb}{cluster}, namespace {config.jobs.namespace}"


def _session(args):
    import boto3

    return boto3.Session(profile_name=args.profile) if args.profile else boto3.Session()


def run(args, config) -> int:
    args.region = config.region
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
    from k8s_charts.job_spec import load_job_spec
    from trainctl.jobs import manifests_of, render_text

    if args.command == "render":
        print(render_text(config, load_job_spec(args.job, config), args.nccl_check), end="")
        return 0
    if getattr(args, "backend", "eks") == "local":
        from trainctl import local

        return local.run(args, config)
    if any(getattr(args, option, None) is not None for option in ("workdir", "nodes", "nproc_per_node")):
        from trainctl.errors import UserError

        raise UserError(f"--backend {args.backend}: got --workdir, --nodes or --nproc-per-node",
                        "allowed with --backend local only")
    if getattr(args, "backend", "eks") == "slurm":
        return slurm(args, config)
    if getattr(args, "on_head_node", False) or getattr(args, "python", None):
        from trainctl.errors import UserError

        raise UserError(f"--backend {args.backend}: got {'--on-head-node' if args.on_head_node else '--python'}",
                        "allowed with --backend slurm only")
    if getattr(args, "backend", "eks") == "batch":
        return batch(args, config)
    if args.command == "submit":
        text = render_text(config, load_job_spec(args.job, config), args.nccl_check)
        objects = manifests_of(text)
        if args.dry_run:
            return dry_run(args, config, objects, text)
        jobs = connect(args, config)
        for obj in objects:
            name = jobs.submit(obj, args.replace, on_wait=lambda n: _say(f"waiting until the old {n} is gone"))
            print(f"submitted {name} to {config.jobs.namespace}")
        if args.follow:
            return follow(jobs, objects[-1]["metadata"]["name"], args.interval)
        if args.wait:
            return wait(jobs, objects[-1]["metadata"]["name"], args.interval)
        return 0
    if args.command == "cancel":
        return cancel(args, connect(args, config))
    return watch(args, connect(args, config))


def dry_run(args, config, objects: list[dict], text: str) -> int:
    """``submit --dry-run``: the manifests on stdout, as ``render`` prints them; with ``server``, each
    one also created with dryRun=All (schema, admission webhooks, quota and the caller's create
    permission, nothing stored), after the same checks as a real submit."""
    from trainctl.errors import UserError

    if args.follow or args.wait:
        raise UserError(f"--dry-run: got {'--follow' if args.follow else '--wait'}",
                        "allowed with --dry-run: --replace and --nccl-check (nothing runs to wait for)")
    if args.dry_run == "server":
        jobs = connect(args, config)
        for obj in objects:
            jobs.submit(obj, args.replace, dry_run=True)
            _say(f"{obj['metadata']['name']}: the API server would accept it (server dry run, nothing created)")
    print(text, end="")
    return 0


def batch(args, config) -> int:
    """submit, status, logs, cancel and list on AWS Batch (trainctl.batch)."""
    from k8s_charts.job_spec import load_job_spec
    from trainctl.batch import BatchJobs
    from trainctl.errors import UserError

    if args.command == "submit":
        spec = load_job_spec(args.job, config)  # checked before any AWS call
        if args.dry_run:
            raise UserError("--backend batch: got --dry-run", "allowed: --dry-run with the eks backend; "
                            "`trainctl render JOB` shows what would run")
        if args.nccl_check or args.follow:
            raise UserError(f"--backend batch: got {'--nccl-check' if args.nccl_check else '--follow'}",
                            "allowed with batch: --replace and --wait; read logs with `trainctl logs --backend batch`")
        jobs = BatchJobs(_session(args), config)
        job_id = jobs.submit(spec, args.replace)
        print(f"submitted {spec.name} to AWS Batch ({job_id}), {spec.max_nodes} nodes")
        if args.wait:
            def batch_state():
                report = jobs.status(spec.name)
                return f"{spec.name}: {report.state}", report.finished, report.state == "SUCCEEDED"

            return _wait_for_end(batch_state, args.interval)
        return 0
    _one_named_job(args, "batch", "each node's log in CloudWatch Logs, the newest attempt")
    jobs = BatchJobs(_session(args), config)
    if args.command == "status":
        report = jobs.status(args.name)
        print(report.format() if args.output == "text" else _dump(asdict(report), args.output))
    elif args.command == "logs":
        node = args.pod if args.pod is not None else jobs.node_for_rank(args.name, args.rank or 0)
        print(jobs.log(args.name, node), end="")
    elif args.command == "cancel":
        jobs.cancel(args.name)
        print(f"cancelled {args.name} on AWS Batch; checkpoints stay on the file system and in S3")
    elif args.command == "list":
        listed = [{"name": job_name, "state": state} for job_name, state in jobs.list()]
        if args.output != "text":
            print(_dump(listed, args.output))
        for row in listed if args.output == "text" else ():
            print(f"{row['name']:<40} {row['state']}")
    return 0


def _one_named_job(args, backend: str, logs: str) -> None:
    """What the Batch and Slurm backends refuse before any call: cancel without exactly one name, the logs
    options they cannot honour (their logs are files, not a pod's stream), a name that is not a job name."""
    from trainctl.errors import UserError, check_name

    if args.command == "cancel" and (args.all or args.name is None):
        raise UserError(f"cancel --backend {backend}: got --all or no name",
                        f"allowed: `trainctl cancel NAME --backend {backend}`")
    if args.command == "logs":
        unsupported = [f"--{o}" for o in ("all", "follow", "previous", "since") if getattr(args, o)]
        if unsupported:
            raise UserError(f"logs --backend {backend}: got {unsupported[0]}",
                            f"allowed with {backend}: --rank or --pod ({logs})")
    name = getattr(args, "name", None)
    if name is not None:
        check_name("job name", name)


def slurm(args, config) -> int:
    """submit, status, logs, cancel and list on the slurm stack's ParallelCluster (trainctl.slurm)."""
    from k8s_charts.job_spec import load_job_spec
    from trainctl.errors import UserError
    from trainctl.slurm import SlurmJobs, SlurmRuntime, render_for

    if config.slurm is None:
        raise UserError("--backend slurm: this platform has no slurm section",
                        "add `slurm: {queues: [{node_group: ...}]}` to the config and deploy "
                        "(see config/slurm-example.yaml)")
    if args.command == "submit":
        spec = load_job_spec(args.job, config)
        script = render_for(config, spec, SlurmRuntime(python=args.python))  # checked before any call
        if args.nccl_check or args.follow or args.replace:
            given = "--nccl-check" if args.nccl_check else "--follow" if args.follow else "--replace"
            raise UserError(f"--backend slurm: got {given}", "allowed with slurm: --dry-run, --wait, --python; "
                            "read logs with `trainctl logs NAME --backend slurm`")
        if args.dry_run:
            if args.dry_run == "server":
                raise UserError("--backend slurm: got --dry-run=server", "allowed: --dry-run (prints the sbatch script)")
            print(script, end="")
            return 0
        jobs = SlurmJobs(_slurm_shell(args, config), config)
        job_id = jobs.submit(spec, script)
        print(f"submitted {spec.name} to Slurm (job {job_id}), {spec.min_nodes}..{spec.max_nodes} nodes "
              f"of queue {spec.node_group}")
        if args.wait:
            def slurm_state():
                report = jobs.status(spec.name)
                requeued = f" (requeued {report.restarts})" if report.restarts else ""
                return f"{spec.name}: {report.state}{requeued}", report.finished, report.state == "COMPLETED"

            return _wait_for_end(slurm_state, args.interval)
        return 0
    _one_named_job(args, "slurm", "each node's log file on /fsx, every incarnation appended")
    jobs = SlurmJobs(_slurm_shell(args, config), config)
    if args.command == "status":
        report = jobs.status(args.name)
        print(report.format() if args.output == "text" else _dump(report.as_dict(), args.output))
    elif args.command == "logs":
        text = jobs.logs(args.name, rank=args.rank, pod=args.pod)
        if jobs.note:
            _say(jobs.note)
        print(text, end="")
    elif args.command == "cancel":
        ids = jobs.cancel(args.name)
        print(f"cancelled {args.name} (Slurm job {', '.join(ids)}): its nodes checkpoint within KillWait; "
              "checkpoints stay on /fsx")
    elif args.command == "list":
        listed = [{"name": row["name"], "job_id": row["job_id"], "state": row["state"], "nodes": row["nodes"]}
                  for row in jobs.jobs()]
        if args.output != "text":
            print(_dump(listed, args.output))
        for row in listed if args.output == "text" else ():
            print(f"{row['name']:<40} {row['state']:<12} job {row['job_id']}, {row['nodes']} node(s)")
    return 0


def _slurm_shell(args, config):
    from trainctl.slurm_transport import LocalShell, SsmShell

    if args.on_head_node:
        return LocalShell()
    return SsmShell(_session(args), region=config.region, cluster_name=config.slurm_cluster_name)


def _dump(data, output: str) -> str:
    """``-o json`` / ``-o yaml``: the same fields as the text, for scripts."""
    import json

    import yaml

    return json.dumps(data, indent=2, default=str) if output == "json" else yaml.safe_dump(data, sort_keys=False).rstrip()


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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


def cancel(args, jobs) -> int:
    from trainctl.errors import UserError

    if args.all == (args.name is not None):
        raise UserError(f"cancel: got {'both a name and --all' if args.all else 'neither a name nor --all'}",
                        "allowed: `trainctl cancel NAME`, or `trainctl cancel --all` for every job")
    if not args.all:
        jobs.cancel(args.name)
        print(f"cancelled {args.name}; checkpoints stay on the file system and in S3")
        return 0
    names = [job["metadata"]["name"] for job in jobs.list()]
    if not names:
        print(f"no jobs in {jobs.namespace}")
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise UserError(f"cancel --all would delete {len(names)} jobs in {jobs.namespace} and nobody can confirm",
                            "run it in a terminal, or add --yes")
        answer = input(f"delete {len(names)} jobs in {jobs.namespace} ({', '.join(names)})? "
                       f"type the namespace to confirm: ")
        if answer.strip() != jobs.namespace:
            print("nothing deleted")
            return 1
    for name in names:  # one DELETE per named job, never one on the collection
        jobs.cancel(name)
        print(f"cancelled {name}")
    print("checkpoints stay on the file system and in S3")
    return 0


def wait(jobs, name: str, interval_s: float = WATCH_INTERVAL_S) -> int:
    """Until the job ends, saying each change of phase and why it waits; 0 if it completed."""
    from trainctl.jobs import status

    def phase():
        report = status(jobs, name)
        line = f"{name}: {report.phase}" + (f" ({report.waiting[-1]})" if report.waiting else "")
        return line, report.finished, report.phase == "Completed"

    return _wait_for_end(phase, interval_s)


def _wait_for_end(read, interval_s: float) -> int:
    """Until the job ends, saying each new line ``read()`` gives; 0 if it succeeded. ``read`` returns
    (line, finished, succeeded): each backend's own states (EKS phases, Batch and Slurm job states)."""
    said = None
    while True:
        line, finished, succeeded = read()
        if line != said:
            _say(line)
            said = line
        if finished:
            return 0 if succeeded else 1
        time.sleep(interval_s)


def follow(jobs, name: str, interval_s: float = WATCH_INTERVAL_S) -> int:
    """Rank 0's log from when its pod runs until the job ends (again after each restart or regroup:
    rank 0 may then be on another pod)."""
    from trainctl.errors import UserError
    from trainctl.jobs import pod_for_rank, status

    while True:
        report = status(jobs, name)
        if report.finished:
            _say(f"{name}: {report.phase}")
            return 0 if report.phase == "Completed" else 1
        try:
            pod = pod_for_rank(jobs, name, 0)
        except UserError:  # no group formed yet
            pod = None
        if any(row[0] == pod and row[2] == "Running" for row in report.pods):
            for chunk in jobs.log(pod, follow=True).stream():
                sys.stdout.write(chunk.decode(errors="replace"))
            continue
        _say(f"{name}: {report.phase}" + (f" ({report.waiting[-1]})" if report.waiting else ""))
        time.sleep(interval_s)


def watch(args, jobs) -> int:
    from trainctl.jobs import pod_at_index, pod_for_rank, status

    if args.command == "status":
        while True:
            report = status(jobs, args.name)
            if args.watch and sys.stdout.isatty() and args.output == "text":
                print("\033[H\033[J", end="")  # clear the screen, as `watch` does
            print(report.format() if args.output == "text" else _dump(report.as_dict(), args.output), flush=True)
            if not args.watch or report.finished:
                return 0
            time.sleep(args.interval)
            if not sys.stdout.isatty():
                print()
    elif args.command == "list":
        listed = [{"name": job["metadata"]["name"], "phase": (job.get("status") or {}).get("state", {}).get(
            "phase", "Pending")} for job in jobs.list()]
        if args.output != "text":
            print(_dump(listed, args.output))
        for row in listed if args.output == "text" else ():
            print(f"{row['name']:<40} {row['phase']}")
    elif args.command == "logs":
        options = {"previous": args.previous, "since_s": args.since}
        if args.all:
            pods = sorted(p.metadata.name for p in jobs.pods(args.name))
        elif args.pod is not None:
            pods = [pod_at_index(jobs, args.name, args.pod)]
        else:
            pods = [pod_for_rank(jobs, args.name, args.rank or 0)]
        if args.all and not pods:
            from trainctl.errors import UserError

            raise UserError(f"job {args.name!r} has no pods", "see `trainctl status " + args.name + "`")
        if args.all and args.follow:
            from trainctl.errors import UserError

            raise UserError("logs: got --all with --follow", "allowed: --follow with one --rank or --pod")
        for pod in pods:
            if args.follow:
                for chunk in jobs.log(pod, follow=True, **options).stream():
                    sys.stdout.write(chunk.decode(errors="replace"))
            elif args.all:
                for line in jobs.log(pod, **options).splitlines():
                    print(f"[{pod}] {line}")
            else:
                print(jobs.log(pod, **options), end="")
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


def connect(args, config):
    from trainctl.jobs import Jobs
    from trainctl.kube import api_client

    return Jobs(api_client(_session(args), config.name_prefix, config.region, args.context), config.jobs.namespace)


def stack_outputs(session, config, stack: str, *keys: str) -> list[str]:
    from trainctl.errors import UserError

    name = f"{config.name_prefix}-{stack}"
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
