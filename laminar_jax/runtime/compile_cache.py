"""The persistent JAX compilation cache every process of a run shares (`run.compile_cache`).

XLA compiles dominate a small run's start-up (the learner's update and log-prob passes, each
rollout's decode steps, the publisher's cast). With the cache, a second run with the same shapes
loads the executables from disk instead. The folder lives outside the run folder (default
~/.cache/laminar/jax) so every run and every run name reuses it; JAX keys entries by the HLO,
the compile options and the jax/jaxlib version, so a stale entry is never loaded.

`enable(path)` sets it in this process (call it before the first compile); `env(path)` gives
the same settings as environment variables for the Ray actors' runtime env.
"""
from __future__ import annotations

import os

# cache every executable, however quick its compile (the tiny model's compiles are < 1 s each,
# JAX's default threshold would skip them, and they add up to many seconds)
_MIN_COMPILE_S = 0
# the compile turns' lock files (laminar_jax.compile_turns), a sub-folder of the cache
TURNS = "turns"


def resolve(path: str | None) -> str | None:
    return None if not path else os.path.abspath(os.path.expanduser(path))


def env(path: str | None) -> dict[str, str]:
    """JAX's own environment variables for the cache (read by jax at import)."""
    path = resolve(path)
    if path is None:
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": path,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(_MIN_COMPILE_S),
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def enable(path: str | None) -> str | None:
    """Turns the cache on in this process (a no-op for None); returns the folder used."""
    path = resolve(path)
    if path is None:
        return None
    import jax

    os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", _MIN_COMPILE_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
