"""Typed platform config, the instance catalog, and the YAML loader."""

from config.catalog import CATALOG, Accelerator, InstanceType, lookup
from config.loader import DEFAULT_CONFIG, ConfigError, load_config, load_config_or_exit, parse_config
from config.node_groups import AcceleratedNodeGroupConfig
from config.platform import PlatformConfig

__all__ = [
    "CATALOG",
    "DEFAULT_CONFIG",
    "Accelerator",
    "AcceleratedNodeGroupConfig",
    "ConfigError",
    "InstanceType",
    "PlatformConfig",
    "load_config",
    "load_config_or_exit",
    "lookup",
    "parse_config",
]
