"""Typed config values: every field of every config section is parsed and checked by pydantic.

Regent's configuration is plain dataclasses (`RunConfig` and its sections `TrainConfig`, `FTConfig`,
`FaultConfig`, `LighthouseConfig`). A value arrives as a string from the command line or as a TOML value; pydantic
turns it into the field's declared type (`int`, `float | None`, `tuple[float, float]`, `Literal[...]`, ...) and
refuses what does not fit. pydantic is the ecosystem's typed-validation library (and is already installed with
the official Kubernetes client); TorchTitan's tyro would also own the command line, which Regent's one-line
errors with a suggested fix (orchestrate/config.py) keep for themselves.

Two command-line spellings are Regent's own and are turned into plain values before pydantic sees them: a comma
list for a list or tuple field (`--fault-kinds kill,hang`), and a duration for a float field (`--fault-every 30s`,
`3m`, `1h30m`). The errors are one line naming the option and, for a `Literal`, the closest allowed value.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from typing import Any

from pydantic import TypeAdapter, ValidationError

_NONE_WORDS = ("none", "null", "")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class ConfigError(ValueError):
    """A configuration problem found before launch (a value that does not fit its field, among others). The
    message is one line that names the option and the fix."""


def parse_duration(text: str | float | int) -> float:
    """'180s', '3m', '1h', '1m30s', '250ms' or a plain number of seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)", s)
    if not parts or "".join(a + b for a, b in parts) != s.replace(" ", ""):
        raise ConfigError(f"cannot read duration {text!r}; write it like 180s, 3m, 1h30m or 90")
    return sum(float(v) * _DURATION_UNITS[u] for v, u in parts)


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter[Any]:
    return TypeAdapter(annotation)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _members(annotation: Any) -> list[Any]:
    """The non-None members of an Optional/Union, or the annotation itself."""
    if _is_union(annotation):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _allows_none(annotation: Any) -> bool:
    return _is_union(annotation) and type(None) in typing.get_args(annotation)


def _prepare(value: Any, annotation: Any) -> Any:
    """Regent's command-line spellings into plain values: 'none', comma lists, durations."""
    if isinstance(value, str) and _allows_none(annotation) and value.strip().lower() in _NONE_WORDS:
        return None
    members = _members(annotation)
    if len(members) != 1:
        return value
    target = members[0]
    origin = typing.get_origin(target)
    if origin in (list, tuple) and isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if target is float and isinstance(value, str) and re.search(r"[a-z]$", value.strip().lower()):
        try:
            return parse_duration(value)
        except ConfigError:  # not a duration either: pydantic's refusal below names the field and the type
            return value
    return value


def _literal_choices(annotation: Any) -> tuple[Any, ...]:
    """The allowed values of a Literal field (also inside Optional and list[...]); () for other fields."""
    for member in _members(annotation):
        if typing.get_origin(member) is typing.Literal:
            return typing.get_args(member)
        if typing.get_origin(member) in (list, tuple):
            for inner in typing.get_args(member):
                if typing.get_origin(inner) is typing.Literal:
                    return typing.get_args(inner)
    return ()


def _describe(annotation: Any) -> str:
    if annotation in (int, float, str, bool):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """`value` (a command-line string or a TOML value) as `annotation`; `ConfigError` naming `where` if it does
    not fit."""
    if annotation is Any:
        return value
    try:
        return _adapter(annotation).validate_python(_prepare(value, annotation))
    except ValidationError as exc:
        raise ConfigError(_message(exc, value, annotation, where)) from None


def _message(exc: ValidationError, value: Any, annotation: Any, where: str) -> str:
    choices = _literal_choices(annotation)
    if choices:
        names = [str(c) for c in choices]
        bad = [str(e.get("input")) for e in exc.errors() if e.get("type") == "literal_error"]
        guess = difflib.get_close_matches(bad[0], names, n=1, cutoff=0.6) if bad else []
        hint = f"; did you mean {guess[0]}?" if guess else ""
        shown = bad[0] if bad else value
        return f"{where}: {shown!r} is not one of {', '.join(names)}{hint}"
    first = exc.errors()[0]
    detail = str(first.get("msg", "")).rstrip(".")
    hint = "; a number of seconds or a duration like 30s, 3m, 1h30m" if float in _members(annotation) else ""
    return f"{where}: expected {_describe(annotation)}, got {value!r} ({detail[:1].lower() + detail[1:]}){hint}"


def field_types(obj_or_cls: Any) -> dict[str, Any]:
    """A config dataclass's fields and their resolved annotations."""
    return dict(_class_field_types(obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)))


@functools.cache
def _class_field_types(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)  # Regent's own config dataclasses: a failure here is a bug
    return tuple((f.name, hints.get(f.name, f.type)) for f in dataclasses.fields(cls))


def check_fields(obj: Any, name: Any) -> None:
    """Check every field of a config dataclass against its type, as it stands (it may have been built in Python,
    not parsed). `name(field)` says how the user writes the option, for the message. Nested config dataclasses
    are checked by their owner, not here."""
    for field_name, annotation in field_types(obj).items():
        value = getattr(obj, field_name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            continue
        try:
            _adapter(annotation).validate_python(value, strict=False)
        except ValidationError as exc:
            raise ConfigError(_message(exc, value, annotation, name(field_name))) from None
