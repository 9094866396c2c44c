"""An App that synthesizes the same under ``npx cdk synth`` and ``python app.py``."""

from __future__ import annotations

import argparse
import json
import os
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


def create_app(argv: list[str] | None = None) -> App:
    """Return the App for this run.

    Under the CDK CLI (which sets ``CDK_OUTDIR``) the CLI already passes cdk.json's and
    cdk.context.json's context. Run directly, read the same files plus ``-c key=value``
    arguments, so both paths give byte-identical templates.
    """
    if os.environ.get("CDK_OUTDIR"):
        return App()
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
    return App(context=cli_context(overrides), outdir=args.output or _cdk_json().get("output", "cdk.out"))
