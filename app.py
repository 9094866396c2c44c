#!/usr/bin/env python3
"""CDK entry point: wiring only. Choose the config with ``-c config=config/<name>.yaml``."""

import sys

from config import DEFAULT_CONFIG, load_config_or_exit
from k8s_charts.node_runtime import NodeRuntimeMissing, select_node

try:  # before aws_cdk loads: jsii starts Node on import (k8s_charts/node_runtime.py says why the pinned one)
    select_node(needed_for="to synthesize (the AWS CDK and cdk8s run on it through jsii)")
except NodeRuntimeMissing as exc:
    sys.exit(f"error: {exc}")

from stacks import app_options, build_app, create_app  # after Node is chosen

options = app_options()
config_path = options.config_path or DEFAULT_CONFIG
config = load_config_or_exit(config_path)  # a bad config ends here, before the App makes its output folder
app = create_app(options)
build_app(app, config, config_path)
app.synth()
