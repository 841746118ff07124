"""Aggregation modes: closed forms, rejected-token denominators, micro-batch and packing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.rl.aggregation import aggregate, local_normaliser
from laminar_jax.rl.spec import AGGREGATIONS

LOSS = jnp.asarray([[1.0, 2.0, 3.0, 99.0], [4.0, jnp.nan, jnp.inf, -1e30]])
MASK = jnp.asarray([[1, 1, 1, 0], [1, 0, 0, 0]], jnp.float32)


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", 10 / 4),
    ("seq-mean-token-sum", (6 + 4) / 2),
    ("seq-mean-token-mean", (2 + 4) / 2),
    ("seq-mean-token-sum-norm", 10 / (2 * 4)),  # Dr.GRPO with C = 4
])
def test_modes_closed_form(mode, expected):
    v = aggregate(LOSS, MASK, mode=mode, norm_constant=4.0)
    np.testing.assert_allclose(v, expected, rtol=1e-6)
    g = jax.grad(lambda x: aggregate(x, MASK, mode=mode, norm_constant=4.0))(LOSS)
    assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(np.asarray(g)[MASK == 0], 0.0)


@pytest.mark.parametrize("mode,kept_denominator,shrunk_denominator", [
    ("token-mean", 7 / 4, 7 / 3),
    ("seq-mean-token-mean", (3 / 3 + 4) / 2, (3 / 2 + 4) / 2),
    ("seq-mean-token-sum", 7 / 2, 7 / 2),
])
def test_rejected_tokens_in_or_out_of_the_denominator(mode, kept_denominator, shrunk_denominator):
    loss_mask = MASK.at[0, 2].set(0.0)  # the token with loss 3 is rejected
    # AReaL / slime: the original mask counts
    v = aggregate(LOSS, loss_mask, mode=mode, denominator_mask=MASK)
    np.testing.assert_allclose(v, kept_denominator, rtol=1e-6)
    # verl: the rejected token leaves the denominator too
    np.testing.assert_allclose(aggregate(LOSS, loss_mask, mode=mode), shrunk_denominator,
                               rtol=1e-6)


def test_normaliser_counts_sequences_with_a_valid_token():
    mask = jnp.asarray([[1, 1, 0], [0, 0, 0], [1, 0, 0]], jnp.float32)
    assert float(local_normaliser(mask, mode="token-mean")) == 3
    assert float(local_normaliser(mask, mode="seq-mean-token-mean")) == 2
    assert float(local_normaliser(mask, mode="seq-mean-token-sum-norm", norm_constant=8)) == 16
    seg = jnp.asarray([[1, 2, 0], [0, 0, 0], [1, 1, 0]])
    assert float(local_normaliser(mask, mode="seq-mean-token-sum", segment_ids=seg)) == 3


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batches_with_the_global_normaliser_sum_to_the_full_batch(mode):
    key = jax.random.PRNGKey(0)
    loss = jax.random.normal(key, (6, 5))
    mask = (jax.random.uniform(jax.random.PRNGKey(1), (6, 5)) > 0.3).astype(jnp.float32)
    mask = mask.at[:, 0].set(1.0)
    kw = {"mode": mode, "norm_constant": 5.0}
    full_v, full_g = jax.value_and_grad(lambda x: aggregate(x, mask, **kw))(loss)
    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
    norm = sum(local_normaliser(mask[p], **kw) for p in parts)
    vs, gs = zip(*[jax.value_and_grad(lambda x, p=p: aggregate(x, mask[p], normaliser=norm, **kw))(
        loss[p]) for p in parts])
    np.testing.assert_allclose(sum(vs), full_v, rtol=1e-5)
    np.testing.assert_allclose(np.concatenate(gs), full_g, rtol=1e-5, atol=1e-8)
    # the trap: normalising each micro-batch and averaging is a different loss
    if mode == "token-mean":
        local = np.mean([aggregate(loss[p], mask[p], **kw) for p in parts])
        assert abs(local - float(full_v)) > 1e-3


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_packed_rows_equal_unpacked(mode):
    unpacked = jnp.asarray([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [6.0, 0.0, 0.0]])
    umask = jnp.asarray([[1, 1, 1], [1, 1, 0], [1, 0, 0]], jnp.float32)
    packed = jnp.asarray([[1.0, 2.0, 3.0, 4.0, 5.0], [6.0, -7e30, 0.0, 0.0, 0.0]])
    pmask = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], jnp.float32)
    seg = jnp.asarray([[1, 1, 1, 2, 2], [1, 0, 0, 0, 0]])  # segment 0 = padding
    kw = {"mode": mode, "norm_constant": 3.0}
    np.testing.assert_allclose(aggregate(packed, pmask, segment_ids=seg, **kw),
                               aggregate(unpacked, umask, **kw), rtol=1e-6)
    np.testing.assert_allclose(aggregate(packed, pmask, segment_ids=seg, max_segments=2, **kw),
                               aggregate(unpacked, umask, **kw), rtol=1e-6)


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="mode='token-average'"):
        aggregate(LOSS, MASK, mode="token-average")
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate(LOSS, MASK, mode="seq-mean-token-sum-norm")
