"""The JAX engine's version-switch plan (`rollout.jax_weights`) against the reference converter
`hf_to_params`: the same leaves bit for bit, checks before any write, one copy on CPU."""
import jax
import ml_dtypes
import numpy as np
import pytest

from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.hf import hf_to_params, name_map, params_to_hf
from laminar_jax.weights import flat
from rollout.jax_weights import WeightPlan


def _model(**overrides):
    """A config and a random params pure dict (float32, numpy) of its shapes."""
    cfg = DecoderConfig.preset("tiny", vocab_size=96, hidden_size=64, intermediate_size=96, num_heads=4,
                               num_kv_heads=2, head_dim=16, **overrides)
    rng = np.random.default_rng(0)
    return cfg, hf_to_params(cfg, {e.hf_name: rng.standard_normal(e.hf_shape, np.float32) for e in name_map(cfg)})


def _relay_views(tensors):
    """Read-only views of one flat buffer, as a rollout gets them from its relay."""
    buf, index = flat.flatten(tensors)
    buf.flags.writeable = False
    return flat.unflatten(buf, index)


@pytest.mark.parametrize("overrides", [dict(), dict(tie_word_embeddings=False, qk_norm=True, qkv_bias=False)])
def test_plan_matches_hf_to_params_exactly(overrides):
    cfg, params = _model(**overrides)
    other = jax.tree.map(lambda x: (x * 1.5 + 0.25).astype(x.dtype), params)
    plan = WeightPlan(cfg, params)
    assert any(s.transpose for s in plan.slots) and any(not s.transpose for s in plan.slots)
    views = _relay_views(params_to_hf(cfg, other))
    got = plan.load(views, where="t")
    want = hf_to_params(cfg, views)
    jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), w), got, want)
    assert jax.tree.structure(got) == jax.tree.structure(want)


def test_relay_dtype_is_cast_in_the_same_pass():
    cfg, params = _model()
    views = _relay_views(params_to_hf(cfg, params, dtype="bfloat16"))
    got = WeightPlan(cfg, params).load(views, where="t")
    want = hf_to_params(cfg, views, dtype="float32")
    jax.tree.map(lambda g, w: (np.testing.assert_array_equal(np.asarray(g), w), g.dtype == np.float32), got, want)
    assert views["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16


def test_bad_tensors_raise_naming_them_before_any_write():
    cfg, params = _model()
    plan = WeightPlan(cfg, params)
    good = params_to_hf(cfg, params)
    with pytest.raises(ValueError, match=r"t: missing tensor 'model.norm.weight'"):
        plan.load({k: v for k, v in good.items() if k != "model.norm.weight"}, where="t")
    with pytest.raises(ValueError, match=r"unexpected tensor 'extra.weight'"):
        plan.load(dict(good, **{"extra.weight": np.zeros(3)}), where="t")
    name = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(64, 95\), expected \(64, 96\)"):
        plan.load(dict(good, **{name: good[name][:, :95]}), where="t")
    with pytest.raises(ValueError, match="lm_head.weight' differs"):  # tied model, explicit head
        plan.load(dict(good, **{"lm_head.weight": good["model.embed_tokens.weight"] + 1}), where="t")
    plan.load(dict(good, **{"lm_head.weight": good["model.embed_tokens.weight"]}), where="t")


def test_cpu_device_put_aliases_the_one_host_copy():
    """The host buffers are 64-byte aligned, so on CPU `device_put` takes them as they are: the
    switch writes each weight exactly once (what bench_engine's "copies" column counts)."""
    cfg, params = _model()
    host = WeightPlan(cfg, params).host(_relay_views(params_to_hf(cfg, params)))
    for leaf in host.values():
        assert leaf.ctypes.data % 64 == 0
        assert jax.device_put(leaf).unsafe_buffer_pointer() == leaf.ctypes.data


def test_consecutive_switches_never_write_the_live_params():
    """Host buffers are reused in turn: a load never writes the arrays the previous load returned
    (the engine's live params on CPU alias them)."""
    cfg, params = _model()
    plan = WeightPlan(cfg, params)
    versions = [jax.tree.map(lambda x, k=k: (x + k).astype(x.dtype), params) for k in range(3)]
    live = None
    for k, tree in enumerate(versions):
        got = plan.load(_relay_views(params_to_hf(cfg, tree)), where="t")
        if live is not None:  # the previous version's arrays are untouched by this load
            jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), w), live, versions[k - 1])
        jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), w), got, tree)
        live = got
