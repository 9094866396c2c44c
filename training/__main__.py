"""``python -m training <subcommand>``: train, prepare-imagenet, allreduce-bench, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Before anything slow (the standard library above is not): a worker whose agent dies while it
# imports torch must not train alone.
from training.loop.worker_guard import die_with_agent  # isort: skip
from training.contract import EXIT_CONFIG, EXIT_DIVERGED  # isort: skip

die_with_agent()

from typed_config import ConfigError  # noqa: E402 - after die_with_agent(): it imports pydantic, which is slow


class _OneLineParser(argparse.ArgumentParser):
    """A command-line mistake is one line naming the option, the value and what is allowed (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message}; see `{self.prog} --help`\n")


def _at_least(minimum: int):
    """An argparse type: a whole number of at least ``minimum``, else one line saying so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"got {text!r}; allowed: a whole number of at least {minimum}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineParser(prog="python -m training", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser(
        "train", help="train (or resume) under torchrun; extra --section.key=value override the config",
        description="Train, or resume from the newest checkpoint in checkpoint.dir. Settings come from --config "
                    "(a YAML file of sections) and then from --section.key=value overrides.",
        epilog="config keys (with their defaults):\n" + "\n".join(_config_keys()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--config", help="YAML trainer config (defaults apply when omitted)")
    train.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")

    bench = commands.add_parser("bench", help="throughput of the trainer against a bare training loop, one process")
    bench.add_argument("--config", help="YAML trainer config; extra --section.key=value override it")
    bench.add_argument("--steps", type=_at_least(1), default=30)
    bench.add_argument("--warmup-steps", type=_at_least(0), default=5)
    bench.add_argument("--repeats", type=_at_least(1), default=3)

    prepare = commands.add_parser("prepare-imagenet", help="val/ flat -> val/<class>/, check the dataset, write a manifest")
    prepare.add_argument("root", help="dataset root holding train/ and val/ (e.g. /fsx/datasets/imagenet)")
    prepare.add_argument("--labels", required=True, help="LOC_val_solution.csv, or a 'file class' text file")
    prepare.add_argument("--expect-classes", type=_at_least(1), default=1000)
    prepare.add_argument("--manifest", help="where to write the class-count manifest (default: ROOT/manifest.json)")
    prepare.add_argument("--verify", action="store_true",
                         help="also decode every image (all cores) and list those that fail in ROOT/bad-images.txt")

    sweep = commands.add_parser("allreduce-bench",
                                help="all-reduce bandwidth sweep across the job's nodes (run under torchrun)")
    sweep.add_argument("--min-bytes", type=_at_least(1), default=8)
    sweep.add_argument("--max-bytes", type=_at_least(1), default=1 << 30)
    sweep.add_argument("--iterations", type=_at_least(1), default=20)
    sweep.add_argument("--warmup", type=_at_least(0), default=5)
    sweep.add_argument("--require-efa", action="store_true", help="fail unless NCCL selected the EFA provider")
    sweep.add_argument("--json", help="also write the table as JSON here")

    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("train", "bench"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args, extra)
    except ConfigError as exc:
        _say("".join(f"config error: {line}\n" for line in str(exc).splitlines()))
        return _usage_status()
    except _diverged() as exc:
        _say(f"error: {exc}\n")
        return EXIT_DIVERGED
    except _user_errors() as exc:
        _say(f"error: {exc}\n")
        return _usage_status()


def _config_keys() -> list[str]:
    from training.config import describe_keys

    return describe_keys()


def _say(lines: str) -> None:
    """One write of whole lines: the ranks of a node share stderr, and their lines must not interleave."""
    sys.stderr.flush()
    sys.stderr.write(lines)
    sys.stderr.flush()


def _usage_status() -> int:
    """2, as for any command line mistake; under an agent 78, which no layer retries."""
    return EXIT_CONFIG if "TORCHELASTIC_RUN_ID" in os.environ else 2


def _diverged() -> tuple[type[Exception], ...]:
    from training.loop.trainer import Diverged

    return (Diverged,)


def _user_errors() -> tuple[type[Exception], ...]:
    from training.diagnostics.allreduce import TransportError
    from training.loop.checkpoint import CheckpointError
    from training.data.datasets import DataError
    from training.device import DeviceError
    from training.data.imagenet import PrepareError

    return (CheckpointError, DataError, DeviceError, PrepareError, TransportError)


def _stopped_status(result) -> int:
    """0 for a finished run; 128 + the signal's number for one this process's signal stopped
    (checkpointed), as a shell reports a process the signal ended: a scheduler or a script must
    not take a stopped run for a finished one. (A stop for a peer's signal exits in train().)"""
    import signal

    from training.loop import signals

    name = signals.received_signal()
    return 128 + signal.Signals[name].value if result.stopped_by_signal and name else 0


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    from training.config import load_train_config

    if args.command == "train":
        config = load_train_config(args.config, extra)
        if args.print_config:
            import yaml

            print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
            return 0
        from training.loop.trainer import train

        return _stopped_status(train(config))
    if args.command == "bench":
        from training.diagnostics.throughput import compare_with_bare_loop

        config = load_train_config(args.config, extra)
        print(compare_with_bare_loop(config, args.steps, args.warmup_steps, args.repeats).table())
        return 0
    if args.command == "prepare-imagenet":
        from training.data.imagenet import prepare_imagenet

        prepare_imagenet(args.root, args.labels, args.expect_classes, args.manifest, args.verify)
        return 0
    from training.diagnostics.allreduce import run_sweep

    return run_sweep(args.min_bytes, args.max_bytes, args.iterations, args.warmup, args.require_efa, args.json)


if __name__ == "__main__":
    sys.exit(main())
