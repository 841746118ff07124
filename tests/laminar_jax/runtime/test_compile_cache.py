"""`run.compile_cache`: a fresh process with the config's folder writes its compiled executables
there (and a second process with the same folder loads them); null leaves JAX's setting alone."""
import os
import subprocess
import sys

import pytest

from laminar_jax.config import load_config
from laminar_jax.config_loader import ConfigError
from laminar_jax.runtime import compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = """
import sys
from laminar_jax.config import load_config
from laminar_jax.runtime import compile_cache
cfg = load_config("configs/default.yaml", [f"run.compile_cache={sys.argv[1]}"])
print("dir", compile_cache.enable(cfg.run.compile_cache))
import jax, jax.numpy as jnp
from jax._src import monitoring
hits = []
monitoring.register_event_listener(lambda name, **kw: hits.append(name) if "cache_hits" in name else None)
print(float(jax.jit(lambda x: (x * 3.0 + 1.0).sum())(jnp.ones(7))))
print("hits", len(hits))
"""


def _run(value, home):
    env = dict(os.environ, PYTHONPATH=REPO, HOME=str(home), JAX_PLATFORMS="cpu")
    for k in list(env):
        if k.startswith("JAX_COMPILATION_CACHE") or k.startswith("JAX_PERSISTENT_CACHE"):
            env.pop(k)
    out = subprocess.run([sys.executable, "-c", SCRIPT, value], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_the_config_folder_gets_the_executables_and_a_second_process_loads_them(tmp_path):
    folder = tmp_path / "cache"
    first = _run(str(folder), tmp_path)
    assert f"dir {folder}" in first and "28.0" in first
    entries = os.listdir(folder)
    assert entries, "no executable cached"
    second = _run(str(folder), tmp_path)
    assert "hits 0" in first and "hits 0" not in second, (first, second)   # loaded from the cache
    assert not (tmp_path / ".cache").exists()       # the default folder was not used


def test_null_leaves_jax_alone():
    import jax
    before = jax.config.jax_compilation_cache_dir
    cfg = load_config("configs/default.yaml", ["run.compile_cache=null"])
    assert cfg.run.compile_cache is None and compile_cache.enable(cfg.run.compile_cache) is None
    assert jax.config.jax_compilation_cache_dir == before


def test_default_is_outside_the_run_folder_and_env_matches():
    cfg = load_config("configs/default.yaml", [])
    path = compile_cache.resolve(cfg.run.compile_cache)
    assert path == os.path.expanduser("~/.cache/laminar/jax")
    assert compile_cache.env(cfg.run.compile_cache)["JAX_COMPILATION_CACHE_DIR"] == path
    assert compile_cache.env(None) == {}
    with pytest.raises(ConfigError, match="run.compile_cache"):
        load_config("configs/default.yaml", ["run.compile_cache="])
