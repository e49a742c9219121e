"""Dataclasses from TOML tables and back, strictly: an unknown key or a value of the wrong type is a
`ConfigError` naming the dotted key (`engine.blok_size`). `config.py` holds the schema; this, the codec."""

import dataclasses
import types
import typing
from typing import Any

from mooncake.errors import ConfigError


def from_dict(cls, data: dict[str, Any], prefix: str = ""):
    """Build dataclass `cls` from a dict, recursing into nested dataclasses; strict about keys and types."""
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}' must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key '{dotted}' (known here: {known})")
        kwargs[key] = _coerce(hints[key], value, dotted)
    return cls(**kwargs)


def _coerce(hint, value, dotted: str):
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, dotted + ".")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _coerce(option, value, dotted)
            except ConfigError:
                continue
        raise ConfigError(f"config key '{dotted}' has the wrong type: {value!r}")
    if hint is type(None):
        if value is None:
            return None
        raise ConfigError(f"config key '{dotted}' must be empty")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"config key '{dotted}' must be a list, got {value!r}")
        (item,) = typing.get_args(hint)[:1]
        items = [_coerce(item, v, f"{dotted}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if hint in (int, float, str, bool):
        if type(value) is not hint:
            raise ConfigError(f"config key '{dotted}' must be {hint.__name__}, got {value!r}")
        return value
    return value


def toml_value(value) -> str:
    """`value` as TOML text (a dataclass as an inline table)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):  # an inline table ([[api.keys]] entries)
        return "{" + ", ".join(f"{f.name} = {toml_value(getattr(value, f.name))}"
                               for f in dataclasses.fields(value)) + "}"
    raise ConfigError(f"cannot write {value!r} as TOML")
