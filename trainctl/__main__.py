"""``trainctl``: preflight an account, stage data, render / submit / watch / cancel training jobs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from config import DEFAULT_CONFIG, ConfigError
from typed_config import exit_on_config_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainctl", description=__doc__)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"platform config (default {DEFAULT_CONFIG})")
    parser.add_argument("--profile", help="AWS profile (default: the usual credential chain)")
    parser.add_argument("--context", help="use this kubeconfig context instead of an EKS token")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("preflight", help="check the account can run the config (read-only)")
    stage = commands.add_parser("stage-data", help="upload a local dataset folder to the imported prefix")
    stage.add_argument("source", type=Path)
    stage.add_argument("--under", default="", help="sub-path below the data prefix, e.g. imagenet/")
    for name, text in (("render", "print the job's manifests"), ("submit", "apply the job to the cluster")):
        command = commands.add_parser(name, help=text)
        command.add_argument("job", type=Path)
        command.add_argument("--nccl-check", action="store_true", help="the job's EFA/NCCL check instead")
        if name == "submit":
            command.add_argument("--replace", action="store_true", help="delete a job of the same name first")
    for name, text in (("status", "phase, pods, rendezvous, last metrics, newest checkpoint"),
                       ("cancel", "delete the job and its pods; checkpoints are kept")):
        commands.add_parser(name, help=text).add_argument("name")
    logs = commands.add_parser("logs", help="a worker's log")
    logs.add_argument("name")
    logs.add_argument("--rank", type=int, default=0)
    logs.add_argument("--follow", "-f", action="store_true")
    commands.add_parser("list", help="the jobs in the jobs namespace")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from config import load_config

        config = load_config(args.config)
        return run(args, config)
    except ConfigError as exc:
        exit_on_config_error(exc)
    except Exception as exc:  # noqa: BLE001 - user mistakes become one line; real faults keep their traceback
        from trainctl.errors import UserError, from_aws

        error = exc if isinstance(exc, UserError) else from_aws(exc, getattr(args, "region", ""))
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2


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
        from tqdm import tqdm

        from trainctl.stage import stage_data

        session = _session(args)
        bucket, prefix = stack_outputs(session, config, "storage", "DataBucketName", "DataPrefix")
        result = stage_data(args.source, session.client("s3", region_name=config.region), bucket,
                            prefix + args.under, progress=tqdm)
        print(f"uploaded {result.uploaded} files ({result.bytes_uploaded} bytes), skipped {result.skipped} "
              f"already there; the file system imports them under /fsx{config.fsx.data_path}")
        return 0
    from k8s_charts.job_spec import load_job_spec
    from trainctl.jobs import render, render_yaml

    if args.command == "render":
        print(render_yaml(render(config, load_job_spec(args.job, config), args.nccl_check)), end="")
        return 0
    jobs = connect(args, config)
    if args.command == "submit":
        objects = render(config, load_job_spec(args.job, config), args.nccl_check)
        for obj in objects:
            print(f"submitted {jobs.submit(obj, args.replace)} to {config.jobs.namespace}")
        return 0
    return watch(args, jobs)


def watch(args, jobs) -> int:
    from trainctl.jobs import pod_for_rank, status

    if args.command == "status":
        print(status(jobs, args.name).format())
    elif args.command == "cancel":
        jobs.cancel(args.name)
        print(f"cancelled {args.name}; checkpoints stay on the file system and in S3")
    elif args.command == "list":
        for job in jobs.list():
            state = (job.get("status") or {}).get("state", {}).get("phase", "Pending")
            print(f"{job['metadata']['name']:<40} {state}")
    elif args.command == "logs":
        pod = pod_for_rank(jobs, args.name, args.rank)
        if args.follow:
            for chunk in jobs.log(pod, follow=True).stream():
                sys.stdout.write(chunk.decode(errors="replace"))
        else:
            print(jobs.log(pod), end="")
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
