"""The JAX engine's version-switch plan (`rollout.jax_weights`) against the reference converter
`hf_to_params`: the same leaves bit for bit (decoder and served layouts), checks before any write,
one counted copy on CPU, and an engine on the served layout computing what the decoder layout does."""
import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.hf import hf_to_params, name_map, params_to_hf
from laminar_jax.weights import flat
from rollout.jax_engine import JaxEngine
from rollout.jax_served import served_map
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


def _served_leaves(cfg, params):
    """The served layout's leaf shapes and dtypes (what the engine gives its plan)."""
    engine = JaxEngine(cfg, params, max_num_seqs=2, max_model_len=32, page_size=8)
    return engine, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(engine._params))


@pytest.mark.parametrize("overrides", [dict(), dict(tie_word_embeddings=False, qk_norm=True, qkv_bias=False)])
def test_served_plan_holds_the_relay_tensors_and_maps_back_to_hf_to_params_exactly(overrides):
    """Served leaves are the relay's tensors bit for bit (no transform), and reading them back
    through the decoder name map gives `hf_to_params`' leaves bit for bit."""
    cfg, params = _model(**overrides)
    _, leaves = _served_leaves(cfg, params)
    plan = WeightPlan(cfg, leaves, served_map(cfg))
    assert not any(s.transpose for s in plan.slots)
    views = _relay_views(params_to_hf(cfg, jax.tree.map(lambda x: (x * 1.5 + 0.25).astype(x.dtype), params)))
    got = plan.load(views, where="t")
    want = hf_to_params(cfg, views)
    for served, dec in zip(served_map(cfg), name_map(cfg)):
        def at(tree, path, layer):
            leaf = np.asarray(tree[path[0]] if len(path) == 1 else tree[path[0]][path[1]])
            return leaf if layer is None else leaf[layer]
        s_leaf = at(got, served.path, served.layer)
        np.testing.assert_array_equal(s_leaf.reshape(served.hf_shape), views[served.hf_name])
        np.testing.assert_array_equal(served.from_hf(dec.to_hf(at(want, dec.path, dec.layer))).reshape(s_leaf.shape),
                                      s_leaf)


@pytest.mark.parametrize("layout", ["served", "decoder"])
def test_a_cpu_switch_copies_the_weights_once_counted(layout):
    """Counted, not timed: every byte is written once into a host buffer and `device_put`
    aliases it (0 bytes copied to the device); only the decoder layout transposes."""
    cfg, params = _model(tie_word_embeddings=False)
    engine = JaxEngine(cfg, params, weight_layout=layout, max_num_seqs=2, max_model_len=32, page_size=8)
    views = _relay_views(params_to_hf(cfg, params))
    engine.load_weights(views, version=1)
    c = engine._weight_plan.counts
    total = sum(v.nbytes for v in views.values())
    assert c["param_bytes"] == total and c["host_bytes"] == total and c["device_copy_bytes"] == 0
    assert (c["transposed_bytes"] == 0) == (layout == "served")
    if layout == "decoder":  # every projection kernel and the head: most of the bytes
        assert c["transposed_bytes"] > 0.5 * total
    hosts = {h.ctypes.data for h in engine._weight_plan._sets[1].values()}  # the set this load wrote
    assert {a.unsafe_buffer_pointer() for a in jax.tree.leaves(engine._params)} == hosts  # no other copy


def test_served_layout_model_computes_the_decoders_logits_before_and_after_a_switch():
    """The engine's model on the served layout (untied head, qk-norm: the paths the tied contract
    checkpoints do not take) gives the learner decoder's logits, eagerly (no compile), and so
    does it after a switch to other weights."""
    from laminar_jax.models.decoder import from_params
    cfg, params = _model(tie_word_embeddings=False, qk_norm=True)
    other = jax.tree.map(lambda x: (x * 0.5).astype(x.dtype), params)
    engine = JaxEngine(cfg, params, max_num_seqs=1, max_model_len=32, page_size=16)
    tokens = (np.arange(12) % cfg.vocab_size)[None].astype(np.int32)
    positions = np.arange(12)[None].astype(np.int32)
    for version, tree in ((0, params), (1, other)):
        if version:
            engine.load_weights(_relay_views(params_to_hf(cfg, tree)), version)
        served = nnx.merge(engine._graphdef, engine._params)
        got = np.asarray(served(tokens, positions))
        want = np.asarray(from_params(cfg, tree)(tokens, positions))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)  # fp32 sums in another order; |logits| ~ 10


def test_the_old_weights_stay_live_and_unchanged_while_a_switch_writes():
    """A switch writes the other buffer set: the arrays the engine ran on before the switch keep
    their values until the next switch, and a rejected load changes nothing."""
    cfg, params = _model()
    engine = JaxEngine(cfg, params, max_num_seqs=2, max_model_len=32, page_size=8)
    before = [np.array(a) for a in jax.tree.leaves(engine._params)]
    old = jax.tree.leaves(engine._params)
    engine.load_weights(_relay_views(params_to_hf(cfg, jax.tree.map(lambda x: (x + 1).astype(x.dtype), params))), 1)
    for a, b in zip(old, before):
        np.testing.assert_array_equal(np.asarray(a), b)
    new = [np.array(a) for a in jax.tree.leaves(engine._params)]
    assert not all(np.array_equal(a, b) for a, b in zip(new, before))
    bad = params_to_hf(cfg, params)
    bad.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing tensor 'model.norm.weight'"):
        engine.load_weights(bad, 2)
    assert engine.weight_version == 1
    for a, b in zip(jax.tree.leaves(engine._params), new):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_weight_layout_choices_are_checked():
    cfg, params = _model()
    with pytest.raises(ValueError, match="weight_layout='hf'"):
        JaxEngine(cfg, params, weight_layout="hf")
    with pytest.raises(ValueError, match="needs weight_layout='decoder'"):
        JaxEngine(cfg.replace(attention="exact"), params, weight_layout="served")
    assert JaxEngine(cfg.replace(attention="exact"), params, max_num_seqs=2, max_model_len=32).weight_layout == "decoder"
    assert JaxEngine(cfg, hf_tensors=params_to_hf(cfg, params), max_num_seqs=2, max_model_len=32).weight_layout == "served"
