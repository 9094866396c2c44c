"""Load a platform config from YAML and turn every mistake into one readable line."""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from config.model import FieldProblem, PlatformConfig

DEFAULT_CONFIG = "config/example.yaml"

# Human wording for the regex constraints in config.model, keyed by pattern.
_PATTERN_HELP = {
    r"^[a-z][a-z0-9-]{0,19}$": "lowercase letters, digits and '-', starting with a letter, at most 20 characters",
    r"^\d{12}$": "a 12-digit AWS account id, quoted, e.g. '123456789012'",
    r"^[a-z]{2}(-[a-z]+)+-\d$": "an AWS region name, e.g. us-west-2",
    r"^v?\d+\.\d+\.\d+$": "an exact version, e.g. 1.2.3",
}


class ConfigError(Exception):
    """A config that cannot be used. ``problems`` holds one line per mistake."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys silently; a config must not lose a setting."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (line {mark.line + 1})", mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(path: str | Path) -> PlatformConfig:
    """Read and validate ``path``. Raises :class:`ConfigError` listing every mistake."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(source, [f"cannot read the file ({exc.strerror}); pass an existing YAML file, "
                                   f"e.g. -c config={DEFAULT_CONFIG}"]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(source, [f"{where}invalid YAML: {getattr(exc, 'problem', None) or exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(source, [f"top level: got {_show(data)}; allowed: a mapping of config keys"])
    return parse_config(data, source)


def parse_config(data: dict[str, Any], source: str = "config") -> PlatformConfig:
    """Validate an already-parsed mapping."""
    try:
        return PlatformConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, format_errors(exc, PlatformConfig)) from None


def load_config_or_exit(path: str | Path) -> PlatformConfig:
    """For entry points: print one line per mistake and exit 2, without a traceback."""
    try:
        return load_config(path)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"config error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


def format_errors(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    lines: list[str] = []
    for err in exc.errors():
        line = _format_one(err, root)
        if line not in lines:
            lines.append(line)
    return lines


def _format_one(err: dict[str, Any], root: type[BaseModel]) -> str:
    loc = err["loc"]
    kind = err["type"]
    ctx = err.get("ctx") or {}
    problem = ctx.get("error")
    if isinstance(problem, FieldProblem):
        path = _path(loc) + _join_field(problem.field)
        reason = f" ({problem.reason})" if problem.reason else ""
        return f"{path}: got {_show(problem.value)}{reason}; allowed: {problem.allowed}"
    path = _path(loc)
    if kind == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        allowed = ", ".join(sorted(parent.model_fields)) if parent else "see the README's config reference"
        return f"{path}: unknown key; allowed keys here: {allowed}"
    if kind == "missing":
        return f"{path}: required key is missing"
    if kind == "string_pattern_mismatch":
        allowed = _PATTERN_HELP.get(ctx.get("pattern"), f"text matching {ctx.get('pattern')}")
        return f"{path}: got {_show(err['input'])}; allowed: {allowed}"
    if kind == "too_short" and "min_length" in ctx:
        return f"{path}: got {_show(err['input'])}; allowed: at least {ctx['min_length']} item(s)"
    if "expected" in ctx:
        return f"{path}: got {_show(err['input'])}; allowed: {ctx['expected']}"
    msg = err["msg"]
    allowed = msg.removeprefix("Input should be ")
    if allowed != msg:
        return f"{path}: got {_show(err['input'])}; allowed: {allowed}"
    return f"{path}: got {_show(err['input'])}; {msg}"


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "top level"


def _join_field(field: str) -> str:
    return field if not field or field.startswith("[") else f".{field}"


def _show(value: Any) -> str:
    """Render a value the way it would be written in YAML/JSON."""
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class reached by following ``loc`` from ``root`` (for listing its keys)."""
    current: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return None
        current = _unwrap_model(current.model_fields[part].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (list, typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _unwrap_model(arg)
            if found is not None:
                return found
    return None
