"""Typed configs from YAML: nested dataclasses built from plain dicts, with errors that name the field.

``load_config(Cls, "recipe.yaml", overrides=["rollout.n=8"])`` reads the YAML, applies ``key.path=value``
overrides (values parsed as YAML; a string field takes the text as written when the parsed value is not a string,
so ``launch.layout=rollout: 1 engine`` or ``name=007`` stay strings), and builds ``Cls`` recursively. A recipe key
that only holds for one value of another (``Cls.DERIVED_KEYS``, e.g. ``launch.layout`` for ``launch.gpus``) is
dropped (back to its default) when that other key is overridden and it is not. An unknown key is refused with the
list of valid keys at that level; a value of the wrong type names its dotted path and the expected type.
Dataclass ``__post_init__`` validation runs as usual; its errors become ``ConfigError`` prefixed with the dotted path.
A ``Literal`` field (a choice among names) is type-checked here (a string for string choices); which names are
valid is the dataclass's own check, whose message names the field and the valid names (from the registry when the
choice has one), so a bad name gets the same error from a recipe as from the dataclass built in code.

Recipes share settings with ``include:`` (``load_recipe``): a top-level ``include: base.yaml`` (or a list of
files) names recipes, relative to the including file, that are read first and deep-merged in order; the including
file's own keys win (mappings merge key by key, anything else replaces). A cycle is refused with its chain.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from sparse_rl_megatron.utils.errors import UserError

T = TypeVar("T")


class ConfigError(UserError, ValueError):
    """A config file or override that does not fit the config dataclasses."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


class OverrideValue(str):
    """The text of a ``key=value`` override (``str`` itself), with ``parsed``, its YAML reading."""

    parsed: Any

    def __new__(cls, text: str, parsed: Any) -> "OverrideValue":
        out = super().__new__(cls, text)
        out.parsed = parsed
        return out


def _plain(value: Any) -> Any:
    """``value`` with every ``OverrideValue`` inside it replaced by its YAML reading (for untyped fields: a
    mapping such as ``warm_start`` given key by key, which is later written back to YAML)."""
    if isinstance(value, OverrideValue):
        return _plain(value.parsed)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _literal_type(tp: Any) -> type | None:
    """The one type of a ``Literal``'s values (``str`` for ``Literal["a", "b"]``), else None."""
    kinds = {type(v) for v in typing.get_args(tp)}
    return kinds.pop() if len(kinds) == 1 else None


def _takes_str(tp: Any) -> bool:
    if tp is str or (typing.get_origin(tp) is typing.Literal and _literal_type(tp) is str):
        return True
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and any(_takes_str(a) for a in typing.get_args(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    if isinstance(value, OverrideValue):  # the YAML reading first; a string field keeps the text as written
        try:
            return _convert(tp, value.parsed, path)
        except ConfigError:
            if _takes_str(tp):
                return str(value)
            raise
    origin = typing.get_origin(tp)
    if tp is Any:
        return _plain(value)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: {value!r} does not fit {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return _plain(dict(value))
    if origin is typing.Literal:
        kind = _literal_type(tp)
        if kind is None:  # mixed value types: the value itself must be one of them
            allowed = typing.get_args(tp)
            if value not in allowed:
                raise ConfigError(f"{path}: must be one of {', '.join(map(str, allowed))}; got {value!r}")
            return value
        return _convert(kind, value, path)  # the names themselves: the dataclass's check (see the docstring)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # PyYAML follows YAML 1.1, which reads ``1e-4`` (no dot in the mantissa) as a string
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{path}: expected float, got {value!r}") from None
    if tp in (int, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; nested dataclass fields take nested mappings."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = path or cls.__name__
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, f"{path}.{name}" if path else name)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        # a ConfigError at every level, so a CLI that catches ConfigError prints one line, not a traceback
        raise ConfigError(f"{path}: {err}" if path else str(err)) from err


def to_dict(obj: Any) -> Any:
    """Plain-data form of a (nested) config dataclass, for YAML/JSON dumps and logs."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (values ``OverrideValue``: the text and its YAML reading)."""
    import yaml

    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.path=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            if isinstance(node.get(part), OverrideValue):  # a section given whole by an earlier override
                node[part] = node[part].parsed
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        try:
            node[parts[-1]] = OverrideValue(raw, yaml.safe_load(raw))
        except yaml.YAMLError as err:
            raise ConfigError(f"override '{item}': the value is not valid YAML ({_yaml_problem(err)})") from None
    return data


def _yaml_problem(err: Exception) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML recipe; a missing, malformed or non-mapping file is a ``ConfigError``
    naming the file (and the line of a syntax error)."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be read: {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: malformed YAML: {_yaml_problem(err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level of a config must be a mapping")
    return data


INCLUDE_KEY = "include"


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``: nested mappings merge key by key, any other value of ``top`` replaces."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_recipe(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The mapping of a YAML recipe with its ``include:`` files merged in (see the module docstring)."""
    path = Path(path)
    resolved = path.resolve()
    if resolved in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, resolved))
        raise ConfigError(f"{path}: include cycle: {cycle}")
    data = read_yaml_mapping(path)
    includes = data.pop(INCLUDE_KEY, None)
    if includes is None:
        return data
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) and i for i in includes):
        raise ConfigError(f"{path}: '{INCLUDE_KEY}' must be a file name or a list of file names, got {includes!r}")
    merged: dict[str, Any] = {}
    for name in includes:
        included = (path.parent / name)
        if not included.is_file():
            raise ConfigError(f"{path}: included file {included} does not exist")
        merged = deep_merge(merged, load_recipe(included, (*_chain, resolved)))
    return deep_merge(merged, data)


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Read a YAML recipe (or start empty) with its includes, apply overrides, and build ``cls``."""
    data: dict[str, Any] = load_recipe(path) if path is not None else {}
    overrides = list(overrides or [])
    drop_derived(data, getattr(cls, "DERIVED_KEYS", {}), overrides)
    apply_overrides(data, overrides)
    return from_dict(cls, data)


def _lookup(data: dict[str, Any], key: str) -> tuple[Any, str]:
    """The mapping that holds dotted ``key`` in ``data`` (None when a section is missing) and its last part."""
    *sections, last = key.split(".")
    node: Any = data
    for part in sections:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), last


def drop_derived(data: dict[str, Any], derived: dict[str, str], overrides: list[str]) -> None:
    """Remove from ``data`` each key of ``derived`` (``{"launch.layout": "launch.gpus"}``: a dotted key that holds
    for one value of another) whose source key an override changes while the key itself is not overridden."""
    import yaml

    given: dict[str, str] = {}
    for item in overrides:
        if "=" in item:
            key, raw = item.split("=", 1)
            given[key.strip()] = raw
    for key, source in derived.items():
        if source not in given or any(k == key or k.startswith(key + ".") for k in given):
            continue
        holder, name = _lookup(data, source)
        try:
            if holder is not None and holder.get(name) == yaml.safe_load(given[source]):
                continue  # overridden with the recipe's own value
        except yaml.YAMLError:
            pass  # apply_overrides names the bad value
        node, last = _lookup(data, key)
        if node is not None:
            node.pop(last, None)
