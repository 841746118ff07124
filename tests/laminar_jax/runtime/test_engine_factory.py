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


def test_vllm_arguments_follow_the_rollouts_accelerators():
    assert engines.vllm_kwargs(0.0, None) == {}  # CPU: vLLM-CPU's defaults
    assert engines.vllm_kwargs(1.0, "GPU") == {"tensor_parallel_size": 1}
    assert engines.vllm_kwargs(0.4, "GPU") == {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.4}
    assert engines.vllm_kwargs(4.0, "GPU") == {"tensor_parallel_size": 4, "distributed_executor_backend": "mp"}
