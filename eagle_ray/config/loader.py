"""Typed configuration from YAML / dicts: dataclasses as the schema, with clear errors.

Unknown keys and wrong types are errors that name the key path and the allowed keys; `key=value`
overrides (dotted paths, YAML-parsed values) apply on top, as on the command line.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message says where and what is allowed."""


def from_dict(cls: type[T], data: dict[str, Any] | None, path: str = "") -> T:
    """Build dataclass `cls` from `data`, checking keys and types recursively."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(_join(path, k) for k in unknown)}; allowed keys"
                          f"{' under ' + path if path else ''}: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    values = {name: _convert(hints[name], value, _join(path, name))
              for name, value in data.items()}
    missing = [name for name, f in fields.items() if name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing required key{'s' if len(missing) > 1 else ''}: "
                          f"{', '.join(_join(path, k) for k in missing)}")
    return cls(**values)


def nested_from_dicts(config: Any) -> None:
    """Turn nested configs given as plain mappings (the Python API, as Ray Serve takes
    `autoscaling_config`) into their dataclasses, checked as YAML is; any other type is a
    `TypeError` naming the key. Called by the configs' `__post_init__`."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        cls = next((a for a in (hints[field.name], *typing.get_args(hints[field.name]))
                    if dataclasses.is_dataclass(a)), None)
        value = getattr(config, field.name)
        if cls is None or value is None or isinstance(value, cls):
            continue
        if not isinstance(value, dict):
            raise TypeError(f"{type(config).__name__}.{field.name} must be {cls.__name__} or "
                            f"a mapping of its keys, got {type(value).__name__}")
        setattr(config, field.name, from_dict(cls, value, field.name))


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`: a config as dotted keys, as overrides name them."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def load_yaml(cls: type[T], path: str | Path, overrides: list[str] | None = None) -> T:
    """Read a YAML config file into `cls`, then apply `key=value` overrides."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path} does not exist") from e
    return from_dict(cls, apply_overrides(data, overrides or []))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, in order."""
    data = dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, dict) else {}
            node = node[part]
        node[leaf] = yaml.safe_load(raw)
    return data


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{path} has the wrong type: got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{path} must be one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        item = args[0] if args else Any
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ConfigError(f"{path} must be {hint.__name__}, got {value!r} "
                              f"({type(value).__name__})")
        return value
    return value
