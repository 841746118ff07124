"""Start-up of `laminar train` (issue 20): what the driver process imports, and the warm-up
running beside Ray's start in a process of its own (`runtime.warm_up`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

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


def test_the_warm_up_runs_in_its_own_process_with_a_runs_xla_flags(tmp_path):
    """`runtime.warm_up.WarmUp`: `laminar sft` in a child process with the XLA flags an actor
    gets (not this process's, which carry the suite's -O0), its failure raised with the exit
    code, a timeout stopping it, and a model already there reused without a process."""
    from laminar_jax.config import load_config
    from laminar_jax.runtime import warm_up
    cfg = load_config("configs/default.yaml", [f"run.out_dir={tmp_path}", "run.name=r", "sft.seq_len=2"])
    assert "optimization_level" in os.environ["XLA_FLAGS"]   # tests/conftest.py
    assert warm_up._env(cfg)["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
    two = load_config("configs/default.yaml", ["mesh.fsdp=2"])
    assert warm_up._env(two)["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"

    failing = warm_up.WarmUp(cfg, str(tmp_path / "r"), announce=False)   # no example fits 2 tokens
    assert failing.proc.pid != os.getpid()
    with pytest.raises(RuntimeError, match=r"warm-up .*laminar sft .*warm_up.yaml.* exit code 1"):
        failing.result(timeout=300)

    slow = warm_up.WarmUp(load_config("configs/default.yaml", [f"run.out_dir={tmp_path}", "run.name=s"]),
                          str(tmp_path / "s"), announce=False)
    with pytest.raises(TimeoutError, match="warm-up"):
        slow.result(timeout=0.2)
    assert slow.proc.poll() is not None, "a timed-out warm-up is stopped"

    done = tmp_path / "d" / "sft" / "sft_model"
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}")
    again = warm_up.WarmUp(cfg, str(tmp_path / "d"), announce=False)
    assert again.proc is None and again.result(timeout=1) == str(done)


def test_warm_imports_load_the_engine_a_rollout_will_build(tmp_path):
    """What a new rollout imports while it waits for its first weights (`engines.warm_imports`,
    sent by `RolloutSpawner`): the JAX engine and its compile cache; nothing for a vLLM rollout
    with a GPU (its import may claim the GPU); and what a new master relay imports
    (`engines.warm_store_reader`). vLLM's engine on CPU is imported likewise: too slow an import
    for this test, it is checked on the vLLM runs' first pulls (test_vllm_train.py)."""
    code = """if True:
        import json, sys
        from laminar_jax.runtime import engines
        engines.warm_imports(None, "vllm", None, 1.0)   # a GPU rollout
        out = ["rollout.jax_engine" in sys.modules, "vllm" in sys.modules]
        engines.warm_imports(None, "jax", sys.argv[1])
        import jax
        out.append("rollout.jax_engine" in sys.modules and jax.config.jax_compilation_cache_dir == sys.argv[1])
        engines.warm_store_reader(None)
        out.append("orbax.checkpoint" in sys.modules)
        print(json.dumps(out))
    """
    cache = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-c", code, cache], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False, True, True]


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
