"""Reading and writing configs as data: YAML with YAML 1.2 booleans, dotted
``key=value`` overrides, and the renamed keys of older recipes.

Nothing here knows the schema; :mod:`epscale.config.recipes` turns the data into a
:class:`~epscale.config.schema.RunConfig`.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from .validate import ConfigError, to_dict

# Keys that moved: old dotted path -> new dotted path. An old recipe (or a run directory's
# config.yaml written before the move) keeps loading; a warning names the new key.
RENAMED_KEYS: dict[str, str] = {
    "moe.compile_kernels": "moe.cpu.elementwise",
}


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 booleans and floats. Only true/false (any case)
    are booleans: YAML 1.1 also reads on/off/yes/no as booleans, which would turn
    ``moe.cpu.elementwise=off`` into False instead of the string 'off'. A number with an
    exponent and no dot (``1e-5``) is a float: YAML 1.1 wants a dot and reads it as the
    string '1e-5' (then rejected as "must be a number")."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def yaml_load(text: str) -> Any:
    """Parse YAML text as configs do (safe, YAML 1.2 booleans)."""
    return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'moe.top_k=2'`` -> (['moe', 'top_k'], 2). The value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key=value (e.g. train.steps=50)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``key=value`` overrides to a nested dict (a copy is returned)."""
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{text}': '{part}' is not a section")
        node[path[-1]] = value
    return out


def renamed_override(text: str) -> str:
    """The override ``text`` with its key under its current name (:data:`RENAMED_KEYS`),
    without a warning: for re-applying overrides already migrated (and warned about) once."""
    path, _ = parse_override(text)
    key = ".".join(path)
    if key not in RENAMED_KEYS:
        return text
    return f"{RENAMED_KEYS[key]}={text.split('=', 1)[1]}"


def migrate_renamed_keys(data: dict[str, Any],
                         where: str | Callable[..., str] = "") -> dict[str, Any]:
    """``data`` (a copy) with every key of :data:`RENAMED_KEYS` moved to its new place,
    with one warning per key naming the new one. Both set at once is an error.

    ``where`` ends the messages with where the keys came from: a fixed suffix
    (``' (in FILE)'``), or a function of the dotted keys concerned that returns it (the
    file for some keys, a command-line override for others).
    """
    place = where if callable(where) else (lambda *keys: where)
    out = copy.deepcopy(data)
    for old, new in RENAMED_KEYS.items():
        *old_sec, old_leaf = old.split(".")
        node = out
        for part in old_sec:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or old_leaf not in node:
            continue
        value = node.pop(old_leaf)
        *new_sec, new_leaf = new.split(".")
        dest = out
        for part in new_sec:
            dest = dest.setdefault(part, {})
            if not isinstance(dest, dict):
                raise ConfigError(f"config key '{old}' moved to '{new}', but "
                                  f"'{part}' is not a section{place(old, new)}")
        if new_leaf in dest:
            raise ConfigError(f"config keys '{old}' and '{new}' are both set{place(old, new)}; "
                              f"'{old}' is the old name of '{new}': keep only '{new}'")
        dest[new_leaf] = value
        warnings.warn(f"config key '{old}' has moved to '{new}'{place(old)}; read as '{new}' "
                      "(rename it)", FutureWarning, stacklevel=3)
    return out


def directory_message(path: Path) -> str:
    """The start of the error for a directory given where a YAML file belongs, naming a
    YAML file inside it when there is one (a run directory holds config.yaml)."""
    inside = sorted(path.glob("*.yaml"), key=lambda f: (f.name != "config.yaml", f.name))
    example = f" (e.g. '{inside[0]}')" if inside else ""
    return f"config file '{path}' is a directory, not a YAML file; give the path of a YAML file{example}"


def load_yaml(path: str | Path, empty_hint: str | None = None) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file.

    A file that sets nothing (empty, or only comments) reads as ``{}``, unless
    ``empty_hint`` (what to do instead) is given: then it is an error, for files where
    setting nothing is a mistake (a run's config, which would train on the defaults
    without a word). An explicit ``{}`` is a deliberate empty mapping and reads as ``{}``.
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(directory_message(p))
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    text = p.read_text()
    try:
        data = yaml_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{p}' is not valid YAML: {e}") from e
    if data is None and empty_hint is not None:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        only_comments = lines and all(line.startswith("#") for line in lines)
        what = "is empty (only comments)" if only_comments else "is empty"
        raise ConfigError(f"config file '{p}' {what}: it sets nothing; {empty_hint}")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping at top level")
    return data


def dump_yaml(cfg: Any, path: str | Path) -> None:
    """Write a config dataclass as YAML (the form :func:`load_yaml` reads back)."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
