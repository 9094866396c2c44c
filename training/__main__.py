"""``python -m training <subcommand>``: train, prepare-imagenet, allreduce-bench, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from typed_config import ConfigError, exit_on_config_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train (or resume) under torchrun; extra --section.key=value override the config")
    train.add_argument("--config", help="YAML trainer config (defaults apply when omitted)")

    bench = commands.add_parser("bench", help="throughput of the trainer against a bare training loop, one process")
    bench.add_argument("--config", help="YAML trainer config; extra --section.key=value override it")
    bench.add_argument("--steps", type=int, default=30)
    bench.add_argument("--warmup-steps", type=int, default=5)
    bench.add_argument("--repeats", type=int, default=3)

    prepare = commands.add_parser("prepare-imagenet", help="val/ flat -> val/<class>/, check the dataset, write a manifest")
    prepare.add_argument("root", help="dataset root holding train/ and val/ (e.g. /fsx/datasets/imagenet)")
    prepare.add_argument("--labels", required=True, help="LOC_val_solution.csv, or a 'file class' text file")
    prepare.add_argument("--expect-classes", type=int, default=1000)
    prepare.add_argument("--manifest", help="where to write the class-count manifest (default: ROOT/manifest.json)")

    sweep = commands.add_parser("allreduce-bench", help="all-reduce bandwidth sweep across the job's nodes (run under torchrun)")
    sweep.add_argument("--min-bytes", type=int, default=8)
    sweep.add_argument("--max-bytes", type=int, default=1 << 30)
    sweep.add_argument("--iterations", type=int, default=20)
    sweep.add_argument("--warmup", type=int, default=5)
    sweep.add_argument("--require-efa", action="store_true", help="fail unless NCCL selected the EFA provider")
    sweep.add_argument("--json", help="also write the table as JSON here")

    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("train", "bench"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args, extra)
    except ConfigError as exc:
        exit_on_config_error(exc)
    except _user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _user_errors() -> tuple[type[Exception], ...]:
    from training.allreduce import TransportError
    from training.data import DataError
    from training.device import DeviceError
    from training.imagenet import PrepareError

    return (DataError, DeviceError, PrepareError, TransportError)


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    from training.config import load_train_config

    if args.command == "train":
        from training.trainer import train

        train(load_train_config(args.config, extra))
        return 0
    if args.command == "bench":
        from training.bench import compare_with_bare_loop

        config = load_train_config(args.config, extra)
        print(compare_with_bare_loop(config, args.steps, args.warmup_steps, args.repeats).table())
        return 0
    if args.command == "prepare-imagenet":
        from training.imagenet import prepare_imagenet

        prepare_imagenet(args.root, args.labels, args.expect_classes, args.manifest)
        return 0
    from training.allreduce import run_sweep

    return run_sweep(args.min_bytes, args.max_bytes, args.iterations, args.warmup, args.require_efa, args.json)


if __name__ == "__main__":
    sys.exit(main())
