"""An App that synthesizes the same under ``npx cdk synth`` and ``python app.py``."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from aws_cdk import App

REPO_ROOT = Path(__file__).resolve().parent.parent


def _cdk_json() -> dict:
    return json.loads((REPO_ROOT / "cdk.json").read_text())


def cli_context(overrides: dict | None = None) -> dict:
    """The context the CDK CLI would pass: cdk.json's, the cached lookups, then ``overrides``."""
    cdk_json = _cdk_json()
    context = dict(cdk_json.get("context", {}))
    cached = REPO_ROOT / "cdk.context.json"
    if cached.exists():
        context.update(json.loads(cached.read_text()))
    context.update(overrides or {})
    # What the CLI passes by default (path metadata on, version reporting off per cdk.json).
    context.setdefault("aws:cdk:enable-path-metadata", True)
    context.setdefault("aws:cdk:enable-asset-metadata", True)
    context.setdefault("aws:cdk:version-reporting", cdk_json.get("versionReporting", True))
    return context


@dataclass(frozen=True)
class AppOptions:
    """What this run asks for: its context and, run directly, the output folder."""

    context: dict
    outdir: str | None  # None under the CDK CLI, which chose it already

    @property
    def config_path(self) -> str | None:
        return self.context.get("config")


def app_options(argv: list[str] | None = None) -> AppOptions:
    """The run's context, read without creating anything (an App creates its output folder).

    Under the CDK CLI (which sets ``CDK_OUTDIR``) the CLI passes cdk.json's and
    cdk.context.json's context in ``CDK_CONTEXT_JSON`` (or, when large, a file named by
    ``CONTEXT_OVERFLOW_LOCATION_ENV``; aws-cdk-lib cx-api/lib/cxapi.d.ts). Run directly, read the
    same files plus ``-c key=value`` arguments, so both paths give byte-identical templates.
    """
    if os.environ.get("CDK_OUTDIR"):
        context = json.loads(os.environ.get("CDK_CONTEXT_JSON") or "{}")
        overflow = os.environ.get("CONTEXT_OVERFLOW_LOCATION_ENV")
        if overflow:
            context.update(json.loads(Path(overflow).read_text()))
        return AppOptions(context, None)
    parser = argparse.ArgumentParser(prog="python app.py", description="Synthesize the platform without the CDK CLI.")
    parser.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("-o", "--output", default=None, help="output directory (default: cdk.json's, cdk.out)")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.context:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"-c {item}: expected KEY=VALUE, e.g. -c config=config/example.yaml")
        overrides[key] = value
    return AppOptions(cli_context(overrides), args.output or _cdk_json().get("output", "cdk.out"))


def create_app(options: AppOptions | None = None) -> App:
    """The App for this run (see :func:`app_options`); it creates the output folder."""
    options = options or app_options()
    if options.outdir is None:
        return App()
    return App(context=options.context, outdir=options.outdir)
