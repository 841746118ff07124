"""Blockwise (flash-style) attention against the materialised-scores reference, values and grads."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.models import attention as A
from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder, REMAT_POLICIES
from flax import nnx


def _qkv(b, t, h, kh, d, seed=0, s=None):
    r = np.random.RandomState(seed)
    s = t if s is None else s
    f = lambda *shape: jnp.asarray(r.randn(*shape), jnp.float32)  # noqa: E731
    return f(b, t, h, d), f(b, s, kh, d), f(b, s, kh, d), f(b, t, h, d)


def _segments(kind, b, t):
    seg = np.zeros((b, t), np.int32)
    if kind == "full":
        seg[:] = 1
    elif kind == "padded":
        for i in range(b):
            seg[i, :t - 3 * i - 1] = 1
    elif kind == "packed":
        seg[0, :5], seg[0, 5:t - 4] = 1, 2  # two sequences then padding
        seg[-1, :t // 3], seg[-1, t // 3:2 * t // 3], seg[-1, 2 * t // 3:] = 1, 2, 3
    return jnp.asarray(seg)


def _value_and_grads(impl, q, k, v, w, seg, block=None):
    def loss(q, k, v):
        if block:
            pos = jnp.broadcast_to(jnp.arange(q.shape[1]), seg.shape)
            out = A.blockwise(q, k, v, seg, seg, pos, pos, block_q=block, block_k=block)
        else:
            out = A.attention(q, k, v, impl=impl, segment_ids=seg)
        return jnp.sum(out * w), out
    (val, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


@pytest.mark.parametrize("kind,t,h,kh,block", [
    ("padded", 37, 4, 2, 8),    # odd length, GQA, blocks that do not divide T
    ("packed", 41, 6, 3, 16),   # packed rows with padding, GQA 2
    ("full", 24, 4, 1, 512),    # MQA, one block
])
def test_blockwise_matches_naive_values_and_grads(kind, t, h, kh, block):
    q, k, v, w = _qkv(2, t, h, kh, 16, seed=t)
    seg = _segments(kind, 2, t)
    ref_out, ref_g = _value_and_grads("naive", q, k, v, w, seg)
    out, g = _value_and_grads(None, q, k, v, w, seg, block=block)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    for a, b in zip(g, ref_g):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # a query that may read nothing (padding) outputs 0 in both
    assert np.all(np.asarray(out)[np.asarray(seg) == 0] == 0)


def test_cache_path_matches_naive():
    """KV-cache rule: query at position p reads keys 0..p of its slot (decode and prefill)."""
    q, k, v, _ = _qkv(3, 5, 4, 2, 8, seed=1, s=70)
    qpos = jnp.asarray([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14], [69, 69, 69, 69, 69]], jnp.int32)
    ref = A.attention(q, k, v, impl="naive", q_positions=qpos)
    np.testing.assert_allclose(A.attention(q, k, v, impl="blockwise", q_positions=qpos), ref, atol=1e-5)
    one = A.attention(q[:, :1], k, v, impl="blockwise", q_positions=qpos[:, :1])
    np.testing.assert_allclose(one, ref[:, :1], atol=1e-5)


def test_backend_without_implementation_is_a_named_error():
    assert A.resolve("auto", "cpu") == "blockwise" and A.resolve("auto", "gpu") == "cudnn"
    with pytest.raises(ValueError, match=r"model.attention: 'cudnn' is not available on the 'cpu' backend.*blockwise"):
        A.resolve("cudnn", "cpu")
    with pytest.raises(ValueError, match="model.attention"):
        A.resolve("flash3", "cpu")


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_memory_is_linear_and_below_naive():
    """Compiled fwd+bwd temp memory of two layers: blockwise grows ~linearly with T, naive
    quadratically."""
    def grad_fn(impl, t):
        seg = pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (1, t))
        seg = jnp.ones_like(seg)
        if impl == "naive":
            attend = lambda q, k, v: A.naive(q, k, v, seg, seg, pos, pos)  # noqa: E731
        else:
            attend = lambda q, k, v: A.blockwise(q, k, v, seg, seg, pos, pos, block_q=64, block_k=64)  # noqa: E731

        def layers(q, k, v):  # inside a layer scan, as in the decoder (XLA must not hoist the masks)
            out, _ = jax.lax.scan(lambda x, w: (attend(x * w, k, v), None), q, jnp.ones((2,)))
            return jnp.sum(out)
        return jax.grad(layers, argnums=(0, 1, 2))
    mem = {}
    for t in (512, 1024):
        q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((1, t, 4, 16), (1, t, 2, 16), (1, t, 2, 16)))
        mem[t] = {impl: _temp_bytes(grad_fn(impl, t), q, k, v) for impl in ("naive", "blockwise")}
    assert mem[1024]["blockwise"] <= 2.3 * mem[512]["blockwise"]
    assert mem[1024]["naive"] >= 3.0 * mem[512]["naive"]
    assert mem[1024]["blockwise"] * 4 < mem[1024]["naive"]


def test_decoder_blockwise_equals_naive_and_remat_policies_agree():
    cfg = DecoderConfig.preset("tiny", num_layers=2)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 19)), jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(7), np.arange(12)])[None].repeat(2, 0), jnp.int32)
    seg = jnp.asarray(np.array([[1] * 7 + [2] * 12, [1] * 15 + [0] * 4]), jnp.int32)

    def grads(attention, remat):
        model = Decoder(cfg.replace(attention=attention), nnx.Rngs(0), remat=remat)
        graphdef, params = nnx.split(model, nnx.Param)
        w = jax.random.normal(jax.random.key(1), (2, 19, cfg.vocab_size))
        loss = lambda p: jnp.mean(jnp.where(seg[..., None] > 0, nnx.merge(graphdef, p)(tokens, pos, seg), 0) * w)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss)), params

    ref_fn, params = grads("naive", "none")
    ref_val, ref_g = ref_fn(params)
    jaxprs = {}
    for remat in ("none", "block", "dots_saveable"):
        fn, _ = grads("blockwise", remat)
        val, g = fn(params)
        np.testing.assert_allclose(val, ref_val, rtol=1e-5, atol=1e-7)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4), g, ref_g)
        jaxprs[remat] = str(jax.make_jaxpr(fn)(params))
    # the policy changes the program: a checkpoint around each block, with the named policy
    assert "checkpoint" not in jaxprs["none"] and "remat" not in jaxprs["none"]
    assert len(set(jaxprs.values())) == 3  # three different programs (what each saves differs)
