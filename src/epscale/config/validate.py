"""Checking user-facing values: :class:`ConfigError`, and building typed config dataclasses
from plain (nested) dicts with every value type-checked.

Every message names the dotted key, the value and what is allowed, so that a typo in a
recipe or on the command line says where it is and how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import fields
from typing import Any


class ConfigError(ValueError):
    """A configuration value, key or file that cannot work. The message says which and why."""


def fail(key: str, value: Any, allowed: str) -> None:
    """Raise the standard error for ``key = value``: ``allowed`` says what would work."""
    raise ConfigError(f"config key '{key}' = {value!r} is invalid: {allowed}")


def choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    """``value`` must be one of ``allowed``; the error suggests the closest one."""
    if value not in allowed:
        hint = difflib.get_close_matches(str(value), allowed, n=1)
        extra = f"; did you mean '{hint[0]}'?" if hint else ""
        fail(key, value, f"must be one of {', '.join(repr(a) for a in allowed)}{extra}")


def coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a (resolved) type annotation, converting harmless cases
    (an integral float for an int, an int for a float, a dict for a nested dataclass)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None:
            if type(None) in args:
                return None
            fail(key, value, f"must not be null (expected {_type_name(annotation)})")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(key, value, arg)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        fail(key, value, "must be true or false")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        fail(key, value, "must be an integer")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        fail(key, value, "must be a number")
    if annotation is str:
        if isinstance(value, str):
            return value
        fail(key, value, "must be a string")
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            fail(key, value, f"must be a mapping of {annotation.__name__} fields")
        return from_dict(annotation, value, prefix=key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            fail(key, value, "must be a list")
        return origin(value)
    if origin is dict:
        if not isinstance(value, dict):
            fail(key, value, "must be a mapping")
        return value
    return value


def check_types(cfg: Any, prefix: str) -> None:
    """Type-check (and harmlessly coerce) every field of a dataclass built directly in
    Python, so a wrong type gets the same ConfigError as one read from YAML."""
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        if f.init:
            setattr(cfg, f.name, coerce(f"{prefix}.{f.name}", getattr(cfg, f.name), hints[f.name]))


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation))


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a (nested) dict. Unknown keys and wrong types raise
    ConfigError with the dotted key and, for typos, a did-you-mean suggestion."""
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix or cls.__name__}' must be a mapping, "
                          f"got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{dotted}'.{hint} "
                              f"Known keys here: {', '.join(names)}")
        kwargs[key] = coerce(dotted, value, hints[key])
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:  # pragma: no cover - defensive: missing required field
        raise ConfigError(f"config section '{prefix or cls.__name__}': {e}") from e


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config dataclass (for YAML dumps and checkpoints)."""
    return dataclasses.asdict(cfg)
