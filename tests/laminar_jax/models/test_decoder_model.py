"""Decoder invariants that need no reference model: packing, padding, heads, axis names, remat."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder, from_params

ALLOWED_NAMES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", "layers"}


@pytest.fixture(scope="module")
def model():
    return Decoder(DecoderConfig.preset("tiny", arch="qwen3", qkv_bias=False, qk_norm=True), nnx.Rngs(0))


def _tokens(key, shape, vocab=512):
    return jax.random.randint(jax.random.key(key), shape, 0, vocab, dtype=jnp.int32)


def test_packed_row_equals_separate_rows(model):
    a, b = _tokens(1, (1, 7)), _tokens(2, (1, 5))
    pos = lambda n: jnp.arange(n, dtype=jnp.int32)[None]  # noqa: E731
    alone_a = model(a, pos(7))[0]
    alone_b = model(b, pos(5))[0]
    # Row: [a (seg 1), b (seg 2), 3 pads (seg 0)]; positions restart per sequence.
    tokens = jnp.concatenate([a, b, jnp.zeros((1, 3), jnp.int32)], axis=1)
    positions = jnp.concatenate([pos(7), pos(5), jnp.zeros((1, 3), jnp.int32)], axis=1)
    segments = jnp.asarray([[1] * 7 + [2] * 5 + [0] * 3], jnp.int32)
    packed = model(tokens, positions, segments)[0]
    np.testing.assert_allclose(packed[:7], alone_a, atol=1e-5)
    np.testing.assert_allclose(packed[7:12], alone_b, atol=1e-5)
    assert np.isfinite(np.asarray(packed)).all()
    # A row of padding only stays finite too (no NaN from an all-masked softmax).
    pad_row = model(tokens, positions, jnp.zeros_like(segments))
    assert np.isfinite(np.asarray(pad_row)).all()


def test_causal_future_tokens_do_not_change_past_logits(model):
    tokens = _tokens(3, (2, 10))
    positions = jnp.tile(jnp.arange(10, dtype=jnp.int32), (2, 1))
    changed = tokens.at[:, 6:].set((tokens[:, 6:] + 1) % 512)
    np.testing.assert_allclose(model(tokens, positions)[:, :6], model(changed, positions)[:, :6], atol=1e-6)
    assert not np.allclose(model(tokens, positions)[:, 6:], model(changed, positions)[:, 6:], atol=1e-3)


def test_every_param_has_logical_axis_names():
    for cfg in (DecoderConfig.preset("tiny"), DecoderConfig.preset("tiny", tie_word_embeddings=False,
                                                                    qkv_bias=False, qk_norm=True, arch="qwen3")):
        _, params = nnx.split(Decoder(cfg), nnx.Param)
        for path, var in nnx.to_flat_state(params):
            names = var.get_metadata()["out_sharding"]
            assert len(names) == var.get_value().ndim, path
            assert set(names) <= ALLOWED_NAMES, path
            assert (names[0] == "layers") == (path[0] == "layers"), path


def test_logits_are_hidden_times_lm_head_kernel():
    for tie in (True, False):
        m = Decoder(DecoderConfig.preset("tiny", tie_word_embeddings=tie), nnx.Rngs(1))
        tokens = _tokens(4, (2, 6))
        positions = jnp.tile(jnp.arange(6, dtype=jnp.int32), (2, 1))
        expect = np.asarray(m.hidden(tokens, positions)) @ np.asarray(m.lm_head_kernel())
        np.testing.assert_allclose(m(tokens, positions), expect, atol=1e-4, rtol=1e-4)
        if tie:
            np.testing.assert_array_equal(m.lm_head_kernel(), m.embedding.get_value().T)


def test_remat_gives_the_same_gradients(model):
    graphdef, params = nnx.split(model, nnx.Param)
    remat_model = from_params(model.cfg, params.to_pure_dict(), remat=True)
    tokens = _tokens(5, (2, 8))
    positions = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(tokens, positions))[..., 0])

    g_plain = nnx.grad(loss)(model)
    g_remat = nnx.grad(loss)(remat_model)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g_plain)) > 0


def test_bfloat16_compute_returns_fp32_logits_close_to_fp32(model):
    params = nnx.split(model, nnx.Param)[1].to_pure_dict()
    bf16 = from_params(model.cfg.replace(dtype="bfloat16"), params)
    tokens = _tokens(6, (2, 8))
    positions = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
    ref, out = model(tokens, positions), bf16(tokens, positions)
    assert out.dtype == jnp.float32
    assert float(jnp.abs(out - ref).max()) < 0.05 * float(jnp.abs(ref).max())
