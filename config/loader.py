"""Load a platform config from YAML and turn every mistake into one readable line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from config.fields import K8S_NAME_HELP, K8S_NAME_PATTERN
from config.platform import PlatformConfig
from typed_config import ConfigError, exit_on_config_error, read_yaml_mapping, validate

DEFAULT_CONFIG = "config/example.yaml"

# Human wording for the regex constraints of the config's models, keyed by pattern.
_PATTERN_HELP = {
    r"^[a-z][a-z0-9-]{0,19}$": "lowercase letters, digits and '-', starting with a letter, at most 20 characters",
    r"^\d{12}$": "a 12-digit AWS account id, quoted, e.g. '123456789012'",
    r"^[a-z]{2}(-[a-z]+)+-\d$": "an AWS region name, e.g. us-west-2",
    r"^v?\d+\.\d+\.\d+$": "an exact version, e.g. 1.2.3",
    K8S_NAME_PATTERN: K8S_NAME_HELP,
    r"^[\w.-]+/[\w.-]+$": "owner/repository, e.g. my-org/training-platform",
    r"^v\d+\.\d+\.\d+-eksbuild\.\d+$": "an EKS add-on version, e.g. v1.21.1-eksbuild.7",
    r"^cr-[0-9a-f]{17}$": "a capacity reservation id, e.g. cr-0123456789abcdef0",
    r"^arn:aws[a-z-]*:(codeconnections|codestar-connections):[a-z0-9-]+:\d{12}:connection/[0-9a-f-]{36}$":
        "a CodeConnections connection ARN, e.g. arn:aws:codeconnections:us-west-2:123456789012:connection/<uuid>",
}


def load_config(path: str | Path, missing_hint: str = f"pass an existing YAML file, e.g. -c config={DEFAULT_CONFIG}",
                ) -> PlatformConfig:
    """Read and validate ``path``. Raises :class:`ConfigError` listing every mistake. ``missing_hint``:
    how to name another file, in the caller's own syntax (the default is CDK's)."""
    data = read_yaml_mapping(path, missing_hint)
    return parse_config(data, str(path))


def parse_config(data: dict[str, Any], source: str = "config") -> PlatformConfig:
    """Validate an already-parsed mapping."""
    return validate(PlatformConfig, data, source, _PATTERN_HELP)


def load_config_or_exit(path: str | Path) -> PlatformConfig:
    """For entry points: print one line per mistake and exit 2, without a traceback."""
    try:
        return load_config(path)
    except ConfigError as exc:
        exit_on_config_error(exc)


__all__ = ["DEFAULT_CONFIG", "ConfigError", "load_config", "load_config_or_exit", "parse_config"]
