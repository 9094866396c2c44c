#!/usr/bin/env python3
"""CDK entry point: wiring only. Choose the config with ``-c config=config/<name>.yaml``."""

from config import DEFAULT_CONFIG, load_config_or_exit
from stacks import build_app, create_app

app = create_app()
config_path = app.node.try_get_context("config") or DEFAULT_CONFIG
build_app(app, load_config_or_exit(config_path), config_path)
app.synth()
