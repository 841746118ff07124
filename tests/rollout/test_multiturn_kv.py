"""`env.kv_policy` through the multi-turn loop and the worker (scripted engine, a test double;
the real JAX engine's kept pages are tests/rollout/test_jax_kv_keep.py): with "keep" every turn's
request asks the engine to keep its K/V, the worker gives them back when the trajectory ends,
and the reuse the engine reports reaches the trajectory's turn stats and `tool/kv_reuse_frac`;
with "release" nothing is kept."""
import dataclasses

import pytest

from laminar_jax.config import load_config
from laminar_jax.env.metrics import tool_step_metrics
from tests.rollout.test_multiturn import ScriptedEngine, lookup_policy, run_worker


class CachingEngine(ScriptedEngine):
    """Scripted engine that reports, like a real one, the context tokens it did not prefill again:
    prompt + prefix minus the last token, for a continuation that asked to keep its K/V."""

    def __init__(self, policy, version=0):
        super().__init__(policy, version)
        self.keep_flags, self.aborted = [], []

    def add(self, requests):
        requests = list(requests)
        self.keep_flags += [r.keep_kv for r in requests]
        self.cached = {r.id: len(r.prompt_tokens) + len(r.prefix_tokens) - 1 if r.keep_kv and len(r.prefix_tokens)
                       else 0 for r in requests} | getattr(self, "cached", {})
        super().add(requests)

    def step(self):
        return [dataclasses.replace(c, num_cached_tokens=self.cached.pop(c.request_id)) for c in super().step()]

    def abort(self, ids):
        self.aborted += list(ids)
        return super().abort(ids)


@pytest.mark.parametrize("policy", ["keep", "release"])
def test_kv_policy_decides_what_the_engine_keeps_and_what_is_reported(policy):
    worker, trajs, engine = run_worker(lookup_policy, overrides=[f"env.kv_policy={policy}"], engine_cls=CachingEngine)
    keep = policy == "keep"
    assert engine.keep_flags and set(engine.keep_flags) == {keep}
    finished = {f"{t.group_id}/{t.sample_index}" for t in trajs}
    assert finished <= set(engine.aborted), "the worker did not give back the K/V of ended trajectories"
    for t in trajs:
        assert t.turn_stats["turns"] == 2
        context = len(t.prompt_tokens) + int(t.loss_mask.argmin())  # the second turn's prefix starts at the tool output
        assert t.turn_stats["context_tokens"] > context
        assert t.turn_stats["cached_tokens"] == (t.turn_stats["context_tokens"] - 1 if keep else 0)
    frac = tool_step_metrics([t.turn_stats for t in trajs])["tool/kv_reuse_frac"]
    assert 0.9 < frac < 1.0 if keep else frac == 0.0


def test_a_bad_kv_policy_names_the_key():
    with pytest.raises(ValueError, match="env.kv_policy"):
        load_config("configs/default.yaml", ["env.kv_policy=sometimes"])
