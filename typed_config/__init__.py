"""Typed YAML configs whose every mistake is one line: field, bad value, what is allowed.

Shared by the platform config (``config/``) and the trainer's config (``training/``); it
needs only pydantic and PyYAML, so the trainer image carries it without any CDK code.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

Model = TypeVar("Model", bound=BaseModel)


class FieldProblem(ValueError):
    """A rule broken by one field. ``field`` is relative to the model that raised it."""

    def __init__(self, field: str, value: Any, allowed: str, reason: str | None = None):
        self.field = field
        self.value = value
        self.allowed = allowed
        self.reason = reason
        super().__init__(reason or f"{value!r} is not allowed")


class FieldProblems(ValueError):
    """Several rules broken at once, found by one validator: each becomes its own line, so a user
    fixes them all in one pass instead of one per run."""

    def __init__(self, problems: list[FieldProblem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def raise_problems(problems: list[FieldProblem]) -> None:
    """For a model validator that checks every rule before it raises: nothing, one or several."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise FieldProblems(problems)


class StrictModel(BaseModel):
    """Unknown keys are errors, numbers are finite, and a validated config cannot change under its users."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


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


def read_yaml_mapping(path: str | Path, missing_hint: str) -> dict[str, Any]:
    """The top-level mapping of a YAML file, or :class:`ConfigError` with one readable line."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(source, [f"cannot read the file ({exc.strerror}); {missing_hint}"]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(source, [f"{where}invalid YAML: {getattr(exc, 'problem', None) or exc}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, [f"top level: got {show(data)}; allowed: a mapping of config keys"])
    return data


def validate(root: type[Model], data: dict[str, Any], source: str, pattern_help: dict[str, str] | None = None,
             context: dict[str, Any] | None = None) -> Model:
    """``root.model_validate(data)``, with every mistake turned into one line of a :class:`ConfigError`."""
    try:
        return root.model_validate(data, context=context)
    except ValidationError as exc:
        raise ConfigError(source, format_errors(exc, root, pattern_help or {})) from None


def exit_on_config_error(exc: ConfigError, label: str = "config error") -> typing.NoReturn:
    """For entry points: print one line per mistake and exit 2, without a traceback."""
    for line in str(exc).splitlines():
        print(f"{label}: {line}", file=sys.stderr)
    raise SystemExit(2) from None


def format_errors(exc: ValidationError, root: type[BaseModel], pattern_help: dict[str, str],
                  keep: typing.Callable[[str, tuple], bool] | None = None) -> list[str]:
    """One line per mistake. ``keep(path, loc)`` can drop some: ``path`` is the dotted path of the
    field at fault, ``loc`` the model that found it (``()``: a rule of the root model)."""
    lines: list[str] = []
    for err in _one_problem_each(exc.errors()):
        if keep is not None and not keep(*_where(err)):
            continue
        line = _format_one(err, root, pattern_help)
        if line not in lines:
            lines.append(line)
    return lines


def _one_problem_each(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """pydantic's errors, a FieldProblems error split into one error per FieldProblem."""
    split = []
    for err in errors:
        problem = (err.get("ctx") or {}).get("error")
        if isinstance(problem, FieldProblems):
            split += [{**err, "ctx": {**err["ctx"], "error": one}} for one in problem.problems]
        else:
            split.append(err)
    return split


def _where(err: dict[str, Any]) -> tuple[str, tuple]:
    problem = (err.get("ctx") or {}).get("error")
    if isinstance(problem, FieldProblem):
        return (_path(err["loc"]) + _join_field(problem.field) if err["loc"] else problem.field), err["loc"]
    return _path(err["loc"]), err["loc"]


def _format_one(err: dict[str, Any], root: type[BaseModel], pattern_help: dict[str, str]) -> str:
    loc = err["loc"]
    kind = err["type"]
    ctx = err.get("ctx") or {}
    problem = ctx.get("error")
    if isinstance(problem, FieldProblem):
        path = _path(loc) + _join_field(problem.field) if loc else (problem.field or "top level")
        reason = f" ({problem.reason})" if problem.reason else ""
        return f"{path}: got {show(problem.value)}{reason}; allowed: {problem.allowed}"
    path = _path(loc)
    if kind == "extra_forbidden":
        parent = model_at(root, loc[:-1])
        allowed = ", ".join(sorted(parent.model_fields)) if parent else "see docs/config-reference.md"
        return f"{path}: unknown key; allowed keys here: {allowed}"
    if kind == "missing":
        return f"{path}: required key is missing"
    if kind == "string_pattern_mismatch":
        allowed = pattern_help.get(ctx.get("pattern"), f"text matching {ctx.get('pattern')}")
        return f"{path}: got {show(err['input'])}; allowed: {allowed}"
    if kind == "too_short" and "min_length" in ctx:
        return f"{path}: got {show(err['input'])}; allowed: at least {ctx['min_length']} item(s)"
    if "expected" in ctx:
        return f"{path}: got {show(err['input'])}; allowed: {ctx['expected']}"
    msg = err["msg"]
    allowed = msg.removeprefix("Input should be ")
    if allowed != msg:
        return f"{path}: got {show(err['input'])}; allowed: {allowed}"
    return f"{path}: got {show(err['input'])}; {msg}"


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "top level"


def _join_field(field: str) -> str:
    return field if not field or field.startswith("[") else f".{field}"


def show(value: Any) -> str:
    """Render a value the way it would be written in YAML/JSON."""
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class reached by following ``loc`` from ``root`` (for listing its keys)."""
    current: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return None
        current = unwrap_model(current.model_fields[part].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def unwrap_model(annotation: Any) -> Any:
    """The pydantic model inside an annotation such as ``list[Model]`` or ``Model | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (list, typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = unwrap_model(arg)
            if found is not None:
                return found
    return None
