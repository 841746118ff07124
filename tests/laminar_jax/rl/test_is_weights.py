"""Importance weights: TIS, masked IS / IcePop, V-trace, TOPR (closed forms and references)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.rl.is_weights import (behaviour_log_ratio, importance_weights, topr_weights,
                                       vtrace_weights)
from laminar_jax.rl.seq_ops import seq_view

LOG = np.log


def _lr(rows):
    return jnp.asarray([[LOG(r) if r > 0 else 0.0 for r in row] for row in rows], jnp.float32)


def test_behaviour_log_ratio_is_safe_and_detached():
    old = jnp.asarray([[-1.0, -50.0, jnp.nan, 3.0]])
    mu = jnp.asarray([[-1.5, -1.0, -1.0, jnp.inf]])
    mask = jnp.asarray([[1.0, 1.0, 1.0, 0.0]])
    lam = behaviour_log_ratio(old, mu, mask)
    # clamped at -20, non-finite -> 0, masked -> 0
    np.testing.assert_allclose(lam, [[0.5, -20.0, 0.0, 0.0]])
    g = jax.grad(lambda x: jnp.sum(behaviour_log_ratio(x, mu, mask)))(old)
    np.testing.assert_array_equal(g, 0.0)


def test_token_truncated_and_masked_weights():
    mask = jnp.asarray([[1, 1, 1, 1, 0]], jnp.float32)
    lam = _lr([[0.5, 1.5, 3.0, 0.3, 9.0]])
    view = seq_view(mask)
    w, raw = importance_weights(lam, mask, view, level="token", mode="truncate", is_max=2.0)
    np.testing.assert_allclose(w, [[0.5, 1.5, 2.0, 0.3, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(raw, [[0.5, 1.5, 3.0, 0.3, 1.0]], rtol=1e-6)
    w, _ = importance_weights(lam, mask, view, level="token", mode="truncate", is_min=0.4,
                              is_max=None)
    np.testing.assert_allclose(w, [[0.5, 1.5, 3.0, 0.4, 1.0]], rtol=1e-6)
    # IcePop: keep the ratio inside [0.5, 5] (bounds inclusive), zero outside
    w, _ = importance_weights(lam, mask, view, level="token", mode="mask", is_min=0.5, is_max=5.0)
    np.testing.assert_allclose(w, [[0.5, 1.5, 3.0, 0.0, 1.0]], rtol=1e-6)


def test_sequence_and_geometric_weights():
    mask = jnp.asarray([[1, 1, 0], [1, 1, 1]], jnp.float32)
    lam = _lr([[2.0, 1.5, 7.0], [0.5, 0.5, 0.5]])
    view = seq_view(mask)
    w, raw = importance_weights(lam, mask, view, level="sequence", is_max=2.0)
    np.testing.assert_allclose(raw, [[3.0, 3.0, 1.0], [0.125] * 3], rtol=1e-5)
    np.testing.assert_allclose(w, [[2.0, 2.0, 1.0], [0.125] * 3], rtol=1e-5)
    w, _ = importance_weights(lam, mask, view, level="geometric", is_max=None)
    np.testing.assert_allclose(w, [[math.sqrt(3)] * 2 + [1.0], [0.5] * 3], rtol=1e-5)
    w, _ = importance_weights(lam, mask, view, level="sequence", mode="mask", is_min=0.2,
                              is_max=5.0)
    np.testing.assert_allclose(w, [[3.0, 3.0, 1.0], [0.0] * 3], rtol=1e-5)


def _vtrace_reference(rho, rho_bar, c_bar):
    """IMPALA recursion with V = 0, gamma = lambda = 1 and reward 1 at the last step."""
    n = len(rho)
    r = np.zeros(n)
    r[-1] = 1.0
    rho_c = np.minimum(rho_bar, rho)
    c = np.minimum(c_bar, rho)
    v = np.zeros(n + 1)  # v_s - V_s with V = 0; v_n = 0
    for s in reversed(range(n)):
        v[s] = rho_c[s] * r[s] + c[s] * v[s + 1]
    return np.array([rho_c[s] * (r[s] + v[s + 1]) for s in range(n)])


@pytest.mark.parametrize("rho_bar,c_bar", [(1.0, 1.0), (2.0, 0.9), (0.8, 1.5)])
def test_vtrace_matches_the_impala_recursion(rho_bar, c_bar):
    rho = np.array([0.5, 1.7, 0.9, 2.5, 1.2])
    mask = jnp.ones((1, 5))
    w = vtrace_weights(jnp.asarray(LOG(rho))[None], mask, seq_view(mask), rho_bar=rho_bar,
                       c_bar=c_bar)
    np.testing.assert_allclose(w[0], _vtrace_reference(rho, rho_bar, c_bar), rtol=1e-5)


def test_vtrace_skips_masked_tokens_and_padding():
    # a masked (tool) token inside the sequence and padding after it: same weights as without
    rho = np.array([0.5, 1.7, 0.9, 2.5])
    lam = jnp.asarray([[LOG(0.5), LOG(1.7), 5.0, LOG(0.9), LOG(2.5), -3.0]], jnp.float32)
    mask = jnp.asarray([[1, 1, 0, 1, 1, 0]], jnp.float32)
    w = vtrace_weights(lam * mask, mask, seq_view(mask), rho_bar=1.0, c_bar=1.0)
    np.testing.assert_allclose(np.asarray(w)[0, [0, 1, 3, 4]],
                               _vtrace_reference(rho, 1.0, 1.0), rtol=1e-5)


def test_vtrace_on_packed_rows_equals_unpacked():
    lam = jnp.asarray(LOG([[0.5, 1.7, 0.9, 1.3, 0.6, 2.0]]), jnp.float32)
    mask = jnp.ones((1, 6))
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2]])
    w = vtrace_weights(lam, mask, seq_view(mask, seg), rho_bar=1.0, c_bar=1.0)
    np.testing.assert_allclose(w[0, :3], _vtrace_reference(np.array([0.5, 1.7, 0.9]), 1, 1),
                               rtol=1e-5)
    np.testing.assert_allclose(w[0, 3:], _vtrace_reference(np.array([1.3, 0.6, 2.0]), 1, 1),
                               rtol=1e-5)


def test_topr_tapers_only_negative_sequences():
    mask = jnp.asarray([[1, 1], [1, 1], [1, 0]], jnp.float32)
    lam = _lr([[2.0, 1.0], [0.5, 0.5], [0.1, 1.0]])
    adv = jnp.asarray([[-1.0, -1.0], [-1.0, -1.0], [2.0, 2.0]])
    w = topr_weights(lam, adv, mask, seq_view(mask))
    # product ratios 2 -> clip to 1; 0.25 stays; positive advantage -> 1 whatever the ratio
    np.testing.assert_allclose(w, [[1.0, 1.0], [0.25, 0.25], [1.0, 1.0]], rtol=1e-6)
