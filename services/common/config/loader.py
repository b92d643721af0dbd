"""Reading a config: YAML -> typed dataclasses, types checked on the way.

`config_from_dict` is the type phase for any settings dataclass (the mesh
config, and the edge topology and sim profiles, which reuse it); `load_config`
reads the mesh config's YAML and runs both phases, types then bounds.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from .errors import ConfigError
from .mesh import MeshConfig
from .validation import validate_config

__all__ = ["config_from_dict", "load_config", "load_side_file"]

T = typing.TypeVar("T")


def load_config(path: str | Path | None) -> MeshConfig:
    """Read a mesh config from YAML, then run the validation phase; None
    gives the defaults (valid by construction, and checked all the same)."""
    if path is None:
        config = MeshConfig()
    else:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: cannot read config: {exc}") from exc
        config = config_from_dict(MeshConfig, data, str(path))
    validate_config(config, "config" if path is None else str(path))
    return config


def load_side_file(cls: type[T], setting: str, path: Path) -> T:
    """A file a setting names (API keys, admin keys: a mounted Secret), read
    as dataclass `cls`; ConfigError names the setting and the file."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc}") from exc
    return config_from_dict(cls, data, str(path))


def config_from_dict(cls: type[T], data: Any, where: str = "config") -> T:
    """Build dataclass `cls` from plain data, rejecting unknown keys and
    wrong types, with the setting's path in every error. Types only: the
    bounds of a whole mesh config are `validate_config`'s."""
    return typing.cast(T, _convert(cls, data, where))


def _convert_dataclass(tp: type, value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    hints = typing.get_type_hints(tp)
    names = {f.name for f in dataclasses.fields(tp)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(map(str, unknown))}")
    kwargs = {k: _convert(hints[k], v, f"{where}.{k}") for k, v in value.items()}
    return tp(**kwargs)


def _convert(tp: Any, value: Any, where: str) -> Any:
    """`value` as type `tp`: dataclasses, Literal, Optional, list, dict and
    the scalars a YAML document holds."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        _, item = typing.get_args(tp)
        return {str(k): _convert(item, v, f"{where}.{k}") for k, v in value.items()}
    return _convert_scalar(tp, value, where)


def _convert_scalar(tp: Any, value: Any, where: str) -> Any:
    """`value` as one of the scalars a YAML document holds. bool is checked
    apart from int: YAML's `true` must not pass as the integer 1."""
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported setting type {tp!r}")
