"""env.name -> a factory of fresh environments (one per trajectory).

A built-in name (`BUILTIN_ENVS`) or "package.module:Factory", called as Factory(env_config).
`resolve_env` imports it and builds one environment to check it, so a bad name fails with one
line naming env.name before any worker starts.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from laminar_jax.config_loader import ConfigError

BUILTIN_ENVS = {"lookup": "laminar_jax.env.lookup:LookupEnv",
                "python": "laminar_jax.env.python_env:PythonEnv"}


class EnvSpecError(ConfigError):
    """env.name does not name a usable environment."""


def _import(spec: str) -> Callable:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - a user module may fail to import in any way
        raise EnvSpecError(f"env.name {spec!r}: cannot import module {module_name!r} ({type(e).__name__}: {e})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EnvSpecError(f"env.name {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def resolve_env(cfg: Any) -> Callable[[], Any]:
    """`make()` -> a fresh environment for `cfg` (an EnvConfig with a name)."""
    name = cfg.name
    if name is None:
        raise EnvSpecError("env.name is null: no environment configured")
    if ":" not in name and name not in BUILTIN_ENVS:
        raise EnvSpecError(f"env.name {name!r}: not a built-in environment ({', '.join(sorted(BUILTIN_ENVS))}) "
                           f"nor 'package.module:Factory'")
    factory = _import(BUILTIN_ENVS.get(name, name))

    def make():
        return factory(cfg)
    try:
        env = make()
    except Exception as e:  # noqa: BLE001 - the user's constructor
        raise EnvSpecError(f"env.name {name!r}: building an environment raised {type(e).__name__}: {e}") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise EnvSpecError(f"env.name {name!r}: {type(env).__name__} has no {' / '.join(missing)} method "
                           f"(an environment needs reset(row) and step(text))")
    return make
