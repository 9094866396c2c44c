#!/usr/bin/env python3
"""CDK entry point: wiring only. Choose the config with ``-c config=config/<name>.yaml``."""

from config import DEFAULT_CONFIG, load_config_or_exit
from stacks import app_options, build_app, create_app

options = app_options()
config_path = options.config_path or DEFAULT_CONFIG
config = load_config_or_exit(config_path)  # a bad config ends here, before the App makes its output folder
app = create_app(options)
build_app(app, config, config_path)
app.synth()
