"""`models.exact`: batch-invariant building blocks. A token's value does not depend on the rest
of the call (row count, padding, KV window, decode vs training), and the values and gradients
agree with the ordinary implementations to rounding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from laminar_jax.learner import logprobs as lp
from laminar_jax.models import attention as A
from laminar_jax.models import exact as X
from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rowwise_matmul_rows_do_not_depend_on_the_row_count(dtype):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((128, 384)), dtype)   # a shape where a plain dot varies with M
    x = jnp.asarray(rng.standard_normal((40, 128)), dtype)
    f = jax.jit(X.rowwise(lambda w, r: jnp.einsum("te,en->tn", r, w, preferred_element_type=jnp.float32)))
    full = np.asarray(f(w, x))
    for m in (1, 3, 16, 17):
        np.testing.assert_array_equal(np.asarray(f(w, x[:m])), full[:m])
    np.testing.assert_array_equal(np.asarray(f(w, x[5:13])), full[5:13])   # position within a block
    np.testing.assert_allclose(full, np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32)), rtol=2e-2, atol=2e-2)


def test_tree_sum_is_the_sum():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 37)), jnp.float32)
    np.testing.assert_allclose(X.tree_sum(x), x.sum(-1), rtol=1e-6, atol=1e-6)


def test_exact_attention_matches_naive_and_a_decode_query_matches_its_training_row():
    rng = np.random.default_rng(2)
    b, t, h, k, d = 2, 21, 4, 2, 8
    q, kk, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, t, h, d), (b, t, k, d), (b, t, k, d)))
    seg = jnp.asarray(np.r_[[1] * 9 + [2] * 12, [1] * 17 + [0] * 4].reshape(b, t), jnp.int32)  # packed + padded
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = X.attention(q, kk, v, seg, seg, pos, pos)
    np.testing.assert_allclose(out, A.naive(q, kk, v, seg, seg, pos, pos), rtol=1e-5, atol=1e-5)
    # segment 2 of row 0 (tokens 9..20) as a cache of its own, one decode query per position,
    # over a KV window padded to 32: the same bits as in the packed training row
    ks, vs = (jnp.pad(x[:1, 9:], ((0, 0), (0, 20), (0, 0), (0, 0))) for x in (kk, v))
    ones_k = jnp.ones((1, 32), jnp.int32)
    for p in (0, 5, 11):
        dec = X.attention(q[:1, 9 + p:10 + p], ks, vs, jnp.ones((1, 1), jnp.int32), ones_k,
                          jnp.full((1, 1), p, jnp.int32), jnp.arange(32, dtype=jnp.int32)[None])
        np.testing.assert_array_equal(np.asarray(dec), np.asarray(out[:1, 9 + p:10 + p]))


def test_exact_decoder_gradient_is_the_ordinary_one():
    tok = jnp.asarray(np.random.default_rng(3).integers(0, 512, (2, 24)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
    seg = jnp.ones((2, 24), jnp.int32)
    grads = []
    for attention in ("exact", "blockwise"):
        graphdef, state = nnx.split(Decoder(DecoderConfig.preset("tiny", attention=attention), rngs=nnx.Rngs(0)))
        loss = lambda st: lp.sequence_logprobs(nnx.merge(graphdef, st), tok, pos, seg)[0].sum()  # noqa: E731
        grads.append(jax.tree.leaves(jax.jit(jax.grad(loss))(state)))
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
