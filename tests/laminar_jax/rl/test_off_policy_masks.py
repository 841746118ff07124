"""Rejection masks: token / sequence / geometric, OPSM, M2PO."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.rl.off_policy_masks import m2po_mask, opsm_mask, rejection_mask
from laminar_jax.rl.seq_ops import seq_view

LOG = np.log


def test_token_rejection_bounds_are_on_the_ratio():
    mask = jnp.asarray([[1, 1, 1, 1, 0]], jnp.float32)
    lam = jnp.asarray([LOG([0.4, 1.0, 2.5, 0.5, 100.0])], jnp.float32)
    keep = rejection_mask(lam, mask, seq_view(mask), level="token", low=0.5, high=2.0)
    np.testing.assert_array_equal(keep, [[0, 1, 0, 1, 1]])
    # not verl's k1 reading, which would accept [1/high, 1/low] = [0.5, 2.5] here
    keep = rejection_mask(lam, mask, seq_view(mask), level="token", low=0.4, high=2.0)
    np.testing.assert_array_equal(keep, [[1, 1, 0, 1, 1]])


def test_sequence_and_geometric_rejection():
    mask = jnp.asarray([[1, 1, 1], [1, 1, 0], [1, 1, 1]], jnp.float32)
    lam = jnp.asarray(LOG([[1.5, 1.5, 1.0], [1.2, 1.2, 1.0], [1.001, 0.9995, 1.0]]), jnp.float32)
    view = seq_view(mask)
    # products 2.25, 1.44, ~1.0005
    keep = rejection_mask(lam, mask, view, level="sequence", low=0.5, high=2.0)
    np.testing.assert_array_equal(keep, [[0, 0, 0], [1, 1, 1], [1, 1, 1]])
    # geometric means 1.31, 1.2, ~1.00017 against Geo-RS [0.999, 1.001]
    keep = rejection_mask(lam, mask, view, level="geometric", low=0.999, high=1.001)
    np.testing.assert_array_equal(keep, [[0, 0, 0], [0, 0, 1], [1, 1, 1]])


def test_opsm_drops_only_far_off_policy_negative_sequences():
    mask = jnp.asarray([[1, 1], [1, 1], [1, 1]], jnp.float32)
    learner = jnp.asarray([[-1.0, -1.0]] * 3)
    behaviour = learner + jnp.asarray([[0.2, 0.4], [0.2, 0.4], [0.1, 0.1]])  # drift 0.3, 0.3, 0.1
    adv = jnp.asarray([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    keep = opsm_mask(learner, behaviour, adv, mask, seq_view(mask), delta=0.2)
    np.testing.assert_array_equal(keep, [[0, 0], [1, 1], [1, 1]])
    g = jax.grad(lambda x: jnp.sum(opsm_mask(x, behaviour, adv, mask, seq_view(mask),
                                             delta=0.2)))(learner)
    np.testing.assert_array_equal(g, 0.0)


def _m2po_reference(values, valid, tau):
    v = np.where(valid, values, 0.0)
    idx = np.flatnonzero(valid)
    order = idx[np.argsort(-v[idx], kind="stable")]
    keep = np.ones_like(v)
    for k in range(len(order) + 1):
        rest = v[order[k:]]
        if len(rest) == 0 or rest.mean() < tau:
            keep[order[:k]] = 0.0
            return keep
    raise AssertionError


def test_m2po_closed_form():
    # (log w)^2 = [0.25, 0.01, 0.04, 0] -> mean 0.075 >= 0.05; without 0.25 -> 0.0167 < 0.05
    lam = jnp.asarray([[0.5, -0.1, 0.2, 0.0, 30.0]], jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 1, 0]], jnp.float32)
    np.testing.assert_array_equal(m2po_mask(lam, mask, tau=0.05), [[0, 1, 1, 1, 1]])
    np.testing.assert_array_equal(m2po_mask(lam, mask, tau=0.1), [[1, 1, 1, 1, 1]])
    # the two largest must go: mean(0.01, 0) = 0.005 < 0.01 but mean(0.04, 0.01, 0) >= 0.01
    np.testing.assert_array_equal(m2po_mask(lam, mask, tau=0.01), [[0, 1, 0, 1, 1]])


@pytest.mark.parametrize("seed", range(4))
def test_m2po_matches_reference(seed):
    key = jax.random.PRNGKey(seed)
    lam = 0.4 * jax.random.normal(key, (4, 7))
    mask = (jax.random.uniform(jax.random.PRNGKey(seed + 10), (4, 7)) > 0.25).astype(jnp.float32)
    tau = 0.02
    ref = _m2po_reference(np.square(np.asarray(lam)).ravel(), np.asarray(mask).ravel() > 0, tau)
    np.testing.assert_array_equal(np.asarray(m2po_mask(lam, mask, tau=tau)).ravel(), ref)
