"""Render the platform's and a job's manifests into dist/: ``python -m k8s_charts --config ... --job ...``.

The FSx volume needs the storage stack's values. Pass the outputs file that
``cdk deploy --outputs-file cdk-outputs.json`` writes; without it the storage manifest is
left out (it would otherwise hold values typed by hand).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from config import DEFAULT_CONFIG, load_config
from k8s_charts.node_runtime import NodeRuntimeMissing, select_node
from typed_config import ConfigError, exit_on_config_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k8s_charts", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--job", action="append", default=[], help="job spec YAML (repeatable)")
    parser.add_argument("--outputs", help="cdk deploy --outputs-file JSON, for the FSx volume")
    parser.add_argument("--image", help="trainer image for the data preparation job (default: the first job's)")
    parser.add_argument("--out", default="dist")
    parser.add_argument("--no-list", action="store_true", help="do not list the files written (make synth lists "
                        "them once it has moved them in place)")
    args = parser.parse_args(argv)
    try:
        select_node()
    except NodeRuntimeMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from cdk8s import App

    from k8s_charts.render import (
        DATA_PREP_CHART, check_job_names, read_outputs, render_job, render_platform, volume_from_outputs,
    )

    try:
        config = load_config(args.config)
        volume = volume_from_outputs(read_outputs(args.outputs), config) if args.outputs else None
        app = App(outdir=args.out, output_file_extension=".yaml")
        render_platform(app, config, volume)
        from config.job_spec import load_job_spec

        specs = [load_job_spec(path, config) for path in args.job]
        check_job_names(config, list(zip(args.job, specs, strict=True)))
        for spec in specs:
            render_job(app, config, spec)
        image = args.image or (specs[0].image if specs else None)
        if image:
            from k8s_charts.job_charts import DataPrepChart

            DataPrepChart(app, DATA_PREP_CHART, config, image)
    except ConfigError as exc:
        exit_on_config_error(exc)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    for stale in out.glob("*.yaml"):
        stale.unlink()
    app.synth()
    if not args.no_list:
        print(f"manifests: {' '.join(sorted(str(p) for p in out.glob('*.yaml')))}")
    if volume is None:
        print("note: no --outputs given, so no FSx PersistentVolume was rendered; pass the storage stack's "
              "outputs (cdk deploy --outputs-file) to render it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
