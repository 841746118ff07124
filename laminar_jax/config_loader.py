"""Typed YAML configs: frozen dataclasses in, frozen dataclasses out.

`load_config(path, overrides, schema)` reads a YAML file, applies dotted command-line overrides
(`optimizer.lr=1e-6`) and builds the schema's dataclass tree. Every error is a `ConfigError` that
names the file, the dotted key and what was expected, so a typo fails before anything heavy runs.

Field types understood: int, float (ints accepted), bool, str, `Literal[...]`, `tuple[...]`,
`X | None` (and other unions), nested dataclasses. Range checks belong to each dataclass's
`__post_init__`, which raises `ValueError`; the loader adds the file and the dotted key.

No jax import here: the CLI loads configs before deciding which heavy modules it needs.
"""
from __future__ import annotations

import math

import dataclasses
import difflib
import pathlib
import re
import types
import typing
from typing import Any, Iterable, Literal, Union

import yaml

__all__ = [
    "ConfigError", "config_from_dict", "dump_config", "dump_yaml", "load_config", "yaml_load",
]


class ConfigError(ValueError):
    """A config file, override or value is invalid. The message says where and why."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-6` as a float (PyYAML follows YAML 1.1 and needs `1.0e-6`)."""


_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:float"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes what `_Loader` would read as a float (the string "1e-6")."""


_Dumper.yaml_implicit_resolvers = {k: list(v) for k, v in _Loader.yaml_implicit_resolvers.items()}


def yaml_load(text: str) -> Any:
    """`yaml.safe_load` with YAML 1.2 floats (`1e-6` is a float, not a string)."""
    return yaml.load(text, Loader=_Loader)


# ----------------------------------------------------------------------------- conversion

def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0])}"
        return f"a list of {len(args)} items ({', '.join(_describe(a) for a in args)})"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


class _Ctx(typing.NamedTuple):
    source: str
    origins: dict  # dotted key -> the override that set it

    def where(self, key: str) -> str:
        for k, override in self.origins.items():
            if key == k or key.startswith(k + ".") or key.startswith(k + "["):
                return f"{self.source}: override {override!r}"
        return self.source


class _Mismatch(Exception):
    """Value does not fit the type; carries the dotted key where it failed."""

    def __init__(self, key: str, expected: str, value: Any):
        super().__init__(f"{key}: expected {expected}, got {value!r}")
        self.key = key


def _convert(tp: Any, value: Any, key: str, ctx: _Ctx) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch(key, "null", value)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            try:
                return _convert(options[0], value, key, ctx)
            except _Mismatch as e:
                if e.key != key:
                    raise
                raise _Mismatch(key, _describe(tp), value) from None
        for option in options:
            try:
                return _convert(option, value, key, ctx)
            except _Mismatch:
                continue
        raise _Mismatch(key, _describe(tp), value)
    if origin is Literal:
        for allowed in typing.get_args(tp):
            if type(value) is type(allowed) and value == allowed:
                return value
        raise _Mismatch(key, _describe(tp), value)
    if origin is tuple or tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(key, _describe(tp), value)
        args = typing.get_args(tp)
        if not args:
            return tuple(value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{key}[{i}]", ctx) for i, v in enumerate(value))
        if len(args) != len(value):
            raise _Mismatch(key, _describe(tp), value)
        return tuple(_convert(a, v, f"{key}[{i}]", ctx) for i, (a, v) in enumerate(zip(args, value)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch(key, "bool (true/false)", value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch(key, "int", value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch(key, "float", value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch(key, "str", value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, ctx)
    raise TypeError(f"config schema field {key!r} has unsupported type {tp!r}")


def _fields(schema: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = typing.get_type_hints(schema)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(schema) if f.init}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unknown_key(prefix: str, name: str, valid: Iterable[str], source: str) -> ConfigError:
    valid = sorted(valid)
    what = "unknown key" if prefix else "unknown section"
    close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.6)
    hint = (f"did you mean {_join(prefix, close[0])!r}?" if close
            else "valid keys: " + ", ".join(valid))
    return ConfigError(f"{source}: {_join(prefix, str(name))}: {what}; {hint}")


def _blame(schema: type, message: str, prefix: str) -> tuple[str, str]:
    """Which dotted key a `__post_init__` ValueError is about, and the message to show for it.

    Understands messages that start with the field name (`lr: ...`, `lr must ...`,
    `OptimizerConfig.lr=-1: ...`) or that mention exactly one field.
    """
    names = list(_fields(schema))
    body = message.removeprefix(f"{schema.__name__}.")
    for name in sorted(names, key=len, reverse=True):
        m = re.match(rf"^({re.escape(name)}(?:\.\w+)*)\b\s*(=?)[:\s]*(.*)$", body, re.S)
        if m:
            key = _join(prefix, m.group(1))
            if m.group(2):
                return key, f"{key}={m.group(3)}"
            return key, f"{key}: {m.group(3) or message}"
    mentioned = [n for n in names if re.search(rf"\b{re.escape(n)}\b", message)]
    key = _join(prefix, mentioned[0]) if len(mentioned) == 1 else (prefix or "<top>")
    return key, f"{key}: {message}"


def _field_default(f: dataclasses.Field, default: Any) -> Any:
    """The value a field takes when the file leaves it out: the enclosing default's, else its own."""
    if default is not None:
        return getattr(default, f.name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _build(schema: type, data: Any, prefix: str, ctx: _Ctx, default: Any = None) -> Any:
    """`schema` from `data`; a key the data leaves out takes its value in `default` (the enclosing
    section's default instance), so a section named with some keys missing gets, for those keys,
    exactly the value it has when the whole section is missing: one default per key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _Mismatch(prefix or "<top>", _describe(schema), data)
    fields = _fields(schema)
    for name in data:
        if name not in fields:
            raise _unknown_key(prefix, name, fields, ctx.where(_join(prefix, str(name))))
    kwargs = {}
    for name, (tp, f) in fields.items():
        if name in data:
            sub_default = _field_default(f, default)
            if dataclasses.is_dataclass(tp) and isinstance(sub_default, tp) and \
                    (data[name] is None or isinstance(data[name], dict)):
                kwargs[name] = _build(tp, data[name], _join(prefix, name), ctx, sub_default)
            else:
                kwargs[name] = _convert(tp, data[name], _join(prefix, name), ctx)
        elif default is not None:
            kwargs[name] = getattr(default, name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{ctx.where(prefix)}: {_join(prefix, name)}: missing required key "
                              f"(expected {_describe(tp)})")
    try:
        return schema(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        key, text = _blame(schema, str(e), prefix)
        raise ConfigError(f"{ctx.where(key)}: {text}") from None


# ----------------------------------------------------------------------------- overrides

def _leaf_type(schema: type, dotted: str, source: str, override: str) -> Any:
    tp: Any = schema
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if typing.get_origin(tp) in (Union, types.UnionType):
            sections = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
            tp = sections[0] if len(sections) == 1 else tp
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"{source}: override {override!r}: {'.'.join(parts[:i])} "
                              f"is a {_describe(tp)}, not a section")
        fields = _fields(tp)
        if part not in fields:
            raise _unknown_key(".".join(parts[:i]), part, fields,
                               f"{source}: override {override!r}")
        tp = fields[part][0]
    return tp


def _accepts_str(tp: Any) -> bool:
    if tp is str:
        return True
    if typing.get_origin(tp) in (Union, types.UnionType):
        return any(_accepts_str(a) for a in typing.get_args(tp))
    return False


def _apply_overrides(data: dict, overrides: Iterable[str], schema: type,
                     source: str) -> tuple[dict, dict]:
    """Returns the merged data and {dotted key: override text} for error messages."""
    data = dict(data)
    origins: dict[str, str] = {}
    for override in overrides:
        key, sep, raw = override.partition("=")
        key = key.strip()
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"{source}: override {override!r}: expected KEY=VALUE "
                              "with a dotted key, e.g. optimizer.lr=1e-6")
        tp = _leaf_type(schema, key, source, override)
        try:
            value = yaml_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: override {override!r}: cannot parse value: {e}") from None
        here = f"{source}: override {override!r}"
        if dataclasses.is_dataclass(tp):
            # A whole section is merged below and checked with the rest of the file.
            if not isinstance(value, dict):
                raise ConfigError(f"{here}: {key}: expected {_describe(tp)}, got {value!r}")
        else:
            try:
                _convert(tp, value, key, _Ctx(here, {}))
            except _Mismatch as e:
                # `run.name=001` means the string "001" to a str field, not the int 1.
                if value is None or isinstance(value, str) or not _accepts_str(tp):
                    raise ConfigError(f"{here}: {e}") from None
                value = raw
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        old = node.get(parts[-1])
        merge = isinstance(old, dict) and isinstance(value, dict)
        node[parts[-1]] = {**old, **value} if merge else value
        origins[key] = override
    return data, origins


# ----------------------------------------------------------------------------- public API

def config_from_dict(data: dict | None, overrides: Iterable[str] = (), schema: type | None = None,
                     *, source: str = "<dict>") -> Any:
    """Build `schema` from a plain mapping (e.g. a run folder's config.yaml), then overrides."""
    if schema is None:
        from laminar_jax.config import Config as schema
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level, "
                          f"got {type(data).__name__}")
    data, origins = _apply_overrides(data, overrides, schema, source)
    ctx = _Ctx(source, origins)
    try:
        return _build(schema, data, "", ctx)
    except _Mismatch as e:
        raise ConfigError(f"{ctx.where(e.key)}: {e}") from None


def load_config(path: str | pathlib.Path | None, overrides: Iterable[str] = (),
                schema: type | None = None) -> Any:
    """Load a YAML config into the `schema` dataclass (default `laminar_jax.config.Config`).

    `path=None` starts from the schema's defaults. Overrides are `dotted.key=value` strings whose
    values are parsed as YAML (`true`, `1e-6`, `[1, 2]`, `null`).
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    if path is None:
        return config_from_dict({}, overrides, schema, source="<defaults>")
    path = pathlib.Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read: {e.strerror}") from None
    try:
        data = yaml_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {e}") from None
    return config_from_dict(data, overrides, schema, source=source)


def dump_config(cfg: Any) -> Any:
    """The config tree as plain dicts / lists / scalars (what `config_from_dict` reads back)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: dump_config(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
    if isinstance(cfg, dict):
        return {k: dump_config(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [dump_config(v) for v in cfg]
    return cfg


def dump_yaml(cfg: Any) -> str:
    """YAML text of `dump_config(cfg)`, keys in schema order."""
    return yaml.dump(dump_config(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


# ------------------------------------------------------------------ range checks for __post_init__
# Shared by every config schema (run config, simulator scenarios); the loader re-labels the
# ValueError with the file and the dotted key.

def require(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def check_at_least(obj, lower: int, *names: str) -> None:
    for name in names:
        require(getattr(obj, name) >= lower, name, getattr(obj, name), f"an int >= {lower}")


def check_positive(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        require(math.isfinite(v) and v > 0, name, v, "a finite number > 0")


def check_non_negative(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        require(math.isfinite(v) and v >= 0, name, v, "a finite number >= 0")
