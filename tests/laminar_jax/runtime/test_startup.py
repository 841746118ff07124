"""Start-up of `laminar train` (issue 20): what the driver process imports, and the warm-up
running beside Ray's start (`driver._Background`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_the_driver_imports_no_jax_flax_or_orbax():
    """Only the actors compute: the driver module (and the fleet and learner classes it hands to
    Ray) loads without jax, flax and orbax, seconds of every start-up (the warm-up imports them
    when it runs)."""
    code = ("import json, sys; import laminar_jax.runtime.driver; "
            "print(json.dumps(sorted(m for m in ('jax', 'flax', 'orbax', 'optax') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_background_returns_the_value_raises_the_error_and_times_out():
    from laminar_jax.runtime.driver import _Background

    caller = threading.current_thread()
    ran_in = []
    job = _Background(lambda x: ran_in.append(threading.current_thread()) or x * 2, 21)
    assert job.result(timeout=10) == 42 and ran_in[0] is not caller   # on its own thread

    def boom():
        raise ValueError("sft.seq_len too short")
    with pytest.raises(ValueError, match="seq_len"):
        _Background(boom).result(timeout=10)
    with pytest.raises(TimeoutError, match="warm-up"):
        _Background(time.sleep, 5).result(timeout=0.1)


def test_warm_imports_load_the_jax_engine_and_skip_vllm(tmp_path):
    """What a new rollout imports while it waits for its first weights (`engines.warm_imports`,
    sent by `RolloutSpawner`): the JAX engine and its compile cache; nothing for vLLM (its import
    may claim the GPU); and what a new master relay imports (`engines.warm_store_reader`)."""
    code = ("import json, sys; from laminar_jax.runtime import engines; "
            "engines.warm_imports(None, 'vllm', None); a = 'rollout.jax_engine' in sys.modules; "
            "engines.warm_imports(None, 'jax', sys.argv[1]); import jax; "
            "b = 'rollout.jax_engine' in sys.modules and jax.config.jax_compilation_cache_dir == sys.argv[1]; "
            "engines.warm_store_reader(None); "
            "print(json.dumps([a, b, 'orbax.checkpoint' in sys.modules, 'vllm' in sys.modules]))")
    cache = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-c", code, cache], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, True, True, False]


def test_the_background_precompile_yields_after_its_first_bucket():
    """`learner_actor._lower_thread_priority` (passed as precompile_all's after_first) renices
    only the calling thread: the learner's own thread keeps its priority."""
    from laminar_jax.runtime import learner_actor

    seen = {}

    def body():
        learner_actor._lower_thread_priority()
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert seen["thread"] == max(before, learner_actor.PRECOMPILE_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
