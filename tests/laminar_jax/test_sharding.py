"""Mesh construction and logical-axis rules (8 fake CPU devices from conftest)."""
import math

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from laminar_jax import sharding as shd
from laminar_jax.learner import train_state as ts
from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder

RULES = dict(shd.DEFAULT_RULES)


def test_mesh_fills_data_axis_and_uses_auto_axes():
    mesh = shd.make_mesh(-1, 2, 2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert dict(shd.make_mesh(-1, 1, 1).shape)["data"] == len(jax.devices())
    assert dict(shd.make_mesh(1, 4, 1).shape) == {"data": 1, "fsdp": 4, "tensor": 1}
    with pytest.raises(ValueError, match="fsdp\\*tensor=3"):
        shd.make_mesh(-1, 3, 1)
    with pytest.raises(ValueError, match="only 8"):
        shd.make_mesh(4, 2, 2)


def test_logical_to_spec_follows_rules_and_rejects_bad_names():
    assert shd.logical_to_spec(("layers", "embed", "heads", "head_dim")) == P(None, "fsdp", "tensor", None)
    assert shd.logical_to_spec(("vocab", "embed")) == P("tensor", "fsdp")
    assert shd.logical_to_spec(("batch", None)) == P(("data", "fsdp"), None)
    with pytest.raises(ValueError, match="'seq' has no sharding rule"):
        shd.logical_to_spec(("seq",), where="param x")
    with pytest.raises(ValueError, match="two dimensions"):
        shd.logical_to_spec(("heads", "mlp"))
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        shd.logical_to_spec(("embed",), [("embed", "model")])


@pytest.mark.parametrize("shape", [(1, 4, 2), (2, 2, 2), (8, 1, 1)])
def test_decoder_param_shardings_are_what_the_rules_say(shape):
    cfg = DecoderConfig.preset("tiny", tie_word_embeddings=False)
    mesh = shd.make_mesh(*shape)
    init_fn = lambda: Decoder(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    sm = ts.shard_model(init_fn, mesh)
    params = ts.init_params(sm, init_fn)
    flat_axes = dict(jax.tree_util.tree_flatten_with_path(
        sm.logical_axes, is_leaf=lambda x: isinstance(x, tuple))[0])
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    assert len(flat_params) == len(flat_axes) >= 14
    for path, arr in flat_params:
        names = flat_axes[path]
        assert names is not None, f"{path} has no logical names"
        expected = P(*[RULES[n] for n in names])
        assert arr.sharding.spec == expected, path
        # each device holds exactly the slice the spec implies
        shard_shape = tuple(d // math.prod(mesh.shape[a] for a in ((ax,) if isinstance(ax, str) else ax or ()))
                            for d, ax in zip(arr.shape, expected))
        assert {s.data.shape for s in arr.addressable_shards} == {shard_shape}, path
    # the layout rules give the decoder's documented names
    assert flat_axes[(jax.tree_util.DictKey("embedding"),)] == ("vocab", "embed")
    assert params["layers"]["q_kernel"].sharding.spec == P(None, "fsdp", "tensor", None)


def test_param_specs_name_the_param_when_a_dim_does_not_divide():
    cfg = DecoderConfig.preset("tiny", num_kv_heads=1, num_heads=4, qkv_bias=False)
    mesh = shd.make_mesh(4, 1, 2)
    with pytest.raises(ValueError, match="param layers/k_kernel: dimension 2"):
        ts.shard_model(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh)


def test_shard_batch_splits_leading_axis_over_data_and_fsdp():
    mesh = shd.make_mesh(2, 2, 2)
    batch = {"tokens": np.arange(8 * 3).reshape(8, 3), "norm": np.float32(5.0)}
    out = shd.shard_batch(batch, mesh)
    assert out["tokens"].sharding.spec == P(("data", "fsdp"), None)
    assert {s.data.shape for s in out["tokens"].addressable_shards} == {(2, 3)}
    assert out["norm"].sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(out["tokens"]), batch["tokens"])
    with pytest.raises(ValueError, match=r"batch\['tokens'\]: leading dim 6"):
        shd.shard_batch({"tokens": np.zeros((6, 2))}, mesh)


def test_place_params_checks_the_tree_and_places_by_the_rules():
    cfg = DecoderConfig.preset("tiny")
    mesh = shd.make_mesh(2, 2, 2)
    sm = ts.shard_model(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh)
    host = jax.tree.map(lambda a: np.ones(a.shape, np.float64), sm.abstract_params)
    # a numpy tree in another dtype is cast to the param dtype
    placed = ts.place_params(sm, host)
    assert jax.tree.map(lambda x: x.sharding, placed) == sm.param_shardings
    assert {x.dtype for x in jax.tree.leaves(placed)} == {np.dtype(np.float32)}
    bad = dict(host, embedding=np.ones((3, 3)))
    with pytest.raises(ValueError, match=r"ckpt: param embedding has shape \(3, 3\)"):
        ts.place_params(sm, bad, what="ckpt")
    missing = {k: v for k, v in host.items() if k != "final_norm"}
    with pytest.raises(ValueError, match=r"missing params \['final_norm'\]"):
        ts.place_params(sm, missing)


def test_without_axes_gathers_over_the_batch_axes():
    assert shd.without_axes(P(None, "fsdp", "tensor", None), drop_leading=1) == P(None, "tensor", None)
    assert shd.without_axes(P(("data", "fsdp"), "tensor")) == P(None, "tensor")
    assert shd.without_axes(P(("fsdp", "tensor"), None)) == P("tensor", None)
    assert shd.batch_axes() == ("data", "fsdp")
    assert shd.batch_axes([("batch", "fsdp")]) == ("fsdp",)


@pytest.mark.parametrize("tied", [False, True])
def test_train_shardings_gather_each_layer_over_fsdp_and_keep_tensor(tied):
    cfg = DecoderConfig.preset("tiny", tie_word_embeddings=tied)
    sm = ts.shard_model(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), shd.make_mesh(2, 2, 2))
    t = sm.train_shardings()
    assert t.activations.spec == P(("data", "fsdp"), None, None)
    assert t.layer_params["q_kernel"].spec == P(None, "tensor", None)      # [embed, heads, head_dim]
    assert t.layer_params["down_kernel"].spec == P("tensor", None)         # [mlp, embed]
    assert set(t.layer_params) == set(sm.param_shardings["layers"])
    assert t.lm_head.spec == P(None, "tensor")                             # [embed, vocab]
