"""Which platform config a trainctl command uses, found the way kubectl finds its context.

In order: ``--config PATH``, then ``$TRAINCTL_CONFIG``, then the per-user settings file that
``trainctl use-config PATH`` writes (``$XDG_CONFIG_HOME/trainctl/settings.yaml``, by default
under ``~/.config``). Nothing else: no example config stands in for a missing one, because a
command run against the example's cluster and node groups would act on, or refuse, the wrong
thing. The source is named in the one-line header every command prints and in every error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

CONFIG_ENV = "TRAINCTL_CONFIG"
SETTINGS_KEY = "config"


def settings_file() -> Path:
    """The per-user settings file (XDG Base Directory: $XDG_CONFIG_HOME, else ~/.config)."""
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "trainctl" / "settings.yaml"


@dataclass(frozen=True)
class ConfigSource:
    path: str
    origin: str  # "--config", "$TRAINCTL_CONFIG" or the settings file

    def __str__(self) -> str:
        return f"{self.path} (from {self.origin})"


def find_config(flag: str | None) -> ConfigSource:
    from trainctl.errors import UserError

    if flag:
        return ConfigSource(flag, "--config")
    if os.environ.get(CONFIG_ENV):
        return ConfigSource(os.environ[CONFIG_ENV], f"${CONFIG_ENV}")
    settings = settings_file()
    if settings.is_file():
        try:
            data = yaml.safe_load(settings.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise UserError(f"{settings}: cannot be read ({exc.__class__.__name__})",
                            "fix or delete it, or run `trainctl use-config PATH`") from None
        path = data.get(SETTINGS_KEY) if isinstance(data, dict) else None
        if not isinstance(path, str) or not path:
            raise UserError(f"{settings}: {SETTINGS_KEY}: got {path!r}",
                            "allowed: the path of a platform config; run `trainctl use-config PATH` to write it")
        return ConfigSource(path, str(settings))
    raise UserError("no platform config given",
                    f"pass --config PATH, set ${CONFIG_ENV}, or run `trainctl use-config PATH` once "
                    f"(it writes {settings})")


def use_config(path: Path) -> Path:
    """Remember ``path`` (made absolute, so it works from any directory) in the settings file."""
    settings = settings_file()
    settings.parent.mkdir(parents=True, exist_ok=True)
    partial = settings.with_name(settings.name + ".partial")
    partial.write_text(yaml.safe_dump({SETTINGS_KEY: str(path.resolve())}))
    partial.replace(settings)
    return settings
