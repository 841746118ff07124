"""Closed-form values and gradients (d loss / d learner_logp) of every policy surrogate."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.rl import losses
from laminar_jax.rl.aggregation import aggregate

L = np.log


def _row(values):
    return jnp.asarray([values], jnp.float32)


def _sum_value_and_grad(fn, learner, *args, **kw):
    def total(x):
        tok, aux = fn(x, *args, **kw)
        return jnp.sum(tok), (tok, aux)

    (_, (tok, aux)), g = jax.value_and_grad(total, has_aux=True)(learner)
    return np.asarray(tok), aux, np.asarray(g)


def test_ppo_clip_higher_closed_form():
    # ratios 1.5, 1.1, 0.5, 1.5, 0.7 and a padding token with garbage log-probs
    ratio = [1.5, 1.1, 0.5, 1.5, 0.7]
    adv = _row([1.0, 1.0, -2.0, -2.0, 1.0, 7.0])
    old = _row([-1.0] * 5 + [1e30])
    learner = _row([-1.0 + L(r) for r in ratio] + [-1e30])
    mask = _row([1, 1, 1, 1, 1, 0])
    tok, aux, g = _sum_value_and_grad(losses.ppo_clip, learner, old, adv, mask,
                                      eps_low=0.2, eps_high=0.28)
    # max(-A r, -A clip(r, 0.8, 1.28)); the gradient is -A r on the unclipped branch, else 0
    np.testing.assert_allclose(tok[0], [-1.28, -1.1, 1.6, 3.0, -0.7, 0.0], rtol=1e-6)
    np.testing.assert_allclose(g[0], [0.0, -1.1, 0.0, 3.0, -0.7, 0.0], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(aux["clipped_high"][0], [1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(aux["clipped_low"][0], [0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(aux["clipped_dual"][0], np.zeros(6))


def test_dual_clip_caps_negative_advantages():
    ratio = [4.0, 1.5, 4.0]
    adv = _row([-2.0, -2.0, 1.0])
    old = _row([-2.0, -2.0, -2.0])
    learner = _row([-2.0 + L(r) for r in ratio])
    mask = _row([1, 1, 1])
    tok, aux, g = _sum_value_and_grad(losses.ppo_clip, learner, old, adv, mask,
                                      eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
    # A=-2, r=4: max(8, 2.4) = 8 > c|A| = 6 -> 6 (no gradient); r=1.5: 3 < 6 -> 3, grad -A r = 3;
    # A=1, r=4: clipped high -> -1.2, no gradient (dual-clip never binds for A > 0)
    np.testing.assert_allclose(tok[0], [6.0, 3.0, -1.2], rtol=1e-6)
    np.testing.assert_allclose(g[0], [0.0, 3.0, 0.0], atol=1e-6)
    np.testing.assert_array_equal(aux["clipped_dual"][0], [1, 0, 0])
    np.testing.assert_array_equal(aux["clipped_high"][0], [0, 0, 1])


def test_gspo_sequence_ratio_closed_form():
    # seq 0: d = [0.1, 0.3], A = 1 -> s = e^0.2 inside [0.7, 1.3]: L = -e^0.2
    # seq 1: d = [0.5, 0.5, -0.1], A = -1 -> s = e^0.3 = 1.3499 > 1.3: max(1.3499, 1.3) unclipped
    # seq 2: d = [0.3, 0.3], A = 1 -> s = e^0.3 > 1.3: clipped, L = -1.3, no gradient
    d = jnp.asarray([[0.1, 0.3, 0.0], [0.5, 0.5, -0.1], [0.3, 0.3, 9.0]], jnp.float32)
    old = jnp.full((3, 3), -1.0)
    mask = jnp.asarray([[1, 1, 0], [1, 1, 1], [1, 1, 0]], jnp.float32)
    adv = jnp.asarray([[1.0] * 3, [-1.0] * 3, [1.0] * 3])

    def loss(x):
        tok, aux = losses.gspo(x, old, adv, mask, eps_low=0.3, eps_high=0.3)
        return aggregate(tok, mask, mode="seq-mean-token-mean"), aux

    (val, aux), g = jax.value_and_grad(loss, has_aux=True)(old + d)
    s0, s1 = math.exp(0.2), math.exp(0.3)
    np.testing.assert_allclose(val, (-s0 + s1 - 1.3) / 3, rtol=1e-6)
    # dL/dl_{i,t} = -A_i s_i / |y_i| / B'
    expect = np.array([[-s0 / 2, -s0 / 2, 0], [s1 / 3] * 3, [0, 0, 0]]) / 3
    np.testing.assert_allclose(g, expect, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(aux["clipped_high"], [[0, 0, 0], [0, 0, 0], [1, 1, 0]])


def test_gspo_token_matches_gspo_for_uniform_advantages_and_allows_token_advantages():
    key = jax.random.PRNGKey(3)
    old = -jax.random.uniform(key, (3, 4))
    learner = old + 0.05 * jax.random.normal(jax.random.PRNGKey(4), (3, 4))
    mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], jnp.float32)
    adv = jnp.broadcast_to(jnp.asarray([[0.7], [-1.2], [0.4]]), (3, 4))
    for mode in ("token-mean", "seq-mean-token-mean"):
        def agg(fn, x, a):
            return aggregate(fn(x, old, a, mask, eps_low=0.2, eps_high=0.2)[0], mask, mode=mode)
        v1, g1 = jax.value_and_grad(lambda x: agg(losses.gspo, x, adv))(learner)
        v2, g2 = jax.value_and_grad(lambda x: agg(losses.gspo_token, x, adv))(learner)
        np.testing.assert_allclose(v1, v2, rtol=1e-6)
        np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-8)
    # per-token advantages: each token's gradient is -A_t s_i (under a plain sum), s_i = e^0.1
    d = _row([0.05, 0.15])
    tok, _, g = _sum_value_and_grad(losses.gspo_token, -1.0 + d, _row([-1.0, -1.0]),
                                    _row([2.0, -1.0]), _row([1, 1]), eps_low=0.2, eps_high=0.2)
    s = math.exp(0.1)
    np.testing.assert_allclose(tok[0], [-2 * s, s], rtol=1e-6)
    np.testing.assert_allclose(g[0], [-2 * s, s], rtol=1e-6)


def test_cispo_never_zeroes_a_gradient():
    ratio = [1.5, 0.5, 1.1]
    adv = _row([1.0, -2.0, 1.0])
    old = _row([-1.0, -1.0, -1.0])
    learner = _row([-1.0 + L(r) for r in ratio])
    mask = _row([1, 1, 1])
    # paper form (no lower bound): r_hat = min(r, 1.28); value -sg(r_hat) A l (the value that is
    # differentiated), gradient -r_hat A
    tok, aux, g = _sum_value_and_grad(losses.cispo, learner, old, adv, mask,
                                      eps_low=1.0, eps_high=0.28)
    lp = np.asarray(learner[0])
    np.testing.assert_allclose(tok[0], [-1.28 * lp[0], 1.0 * lp[1], -1.1 * lp[2]], rtol=1e-6)
    np.testing.assert_allclose(g[0], [-1.28, 1.0, -1.1], rtol=1e-6)
    np.testing.assert_array_equal(aux["clipped_high"][0], [1, 0, 0])
    # verl form: relative lower bound 0.8 -> r_hat = 0.8 for r = 0.5
    tok, aux, g = _sum_value_and_grad(losses.cispo, learner, old, adv, mask,
                                      eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(g[0], [-1.28, 1.6, -1.1], rtol=1e-6)
    np.testing.assert_array_equal(aux["clipped_low"][0], [0, 1, 0])


def test_gmpo_geometric_mean_closed_form():
    # seq 0, A=1: d=[0.5, 0.1] -> d~ = [0.4 (clipped), 0.1], L = -e^0.25
    # seq 1, A=-1: d=[-0.6, 0.2] -> d~ = max(d, clip(d)) = [-0.4 (clipped), 0.2], L = e^-0.1
    d = jnp.asarray([[0.5, 0.1], [-0.6, 0.2]], jnp.float32)
    old = jnp.full((2, 2), -2.0)
    adv = jnp.asarray([[1.0, 1.0], [-1.0, -1.0]])
    mask = jnp.ones((2, 2))

    def loss(x):
        tok, aux = losses.gmpo(x, old, adv, mask, eps_low=0.4, eps_high=0.4)
        return aggregate(tok, mask, mode="seq-mean-token-mean"), aux

    (val, aux), g = jax.value_and_grad(loss, has_aux=True)(old + d)
    a, b = math.exp(0.25), math.exp(-0.1)
    np.testing.assert_allclose(val, (-a + b) / 2, rtol=1e-6)
    np.testing.assert_allclose(g, [[0.0, -a / 2 / 2], [0.0, b / 2 / 2]], rtol=1e-5, atol=1e-8)
    np.testing.assert_array_equal(aux["clipped_high"], [[1, 0], [0, 0]])
    np.testing.assert_array_equal(aux["clipped_low"], [[0, 0], [1, 0]])


def test_reinforce_value_and_gradient():
    tok, aux, g = _sum_value_and_grad(losses.reinforce, _row([-3.0, -0.5, 1e30]),
                                      _row([2.0, -1.0, 5.0]), _row([1, 1, 0]))
    # value -A l (the value differentiated), gradient -A
    np.testing.assert_allclose(tok[0], [6.0, -0.5, 0.0])
    np.testing.assert_allclose(g[0], [-2.0, 1.0, 0.0])
    assert all(float(np.sum(v)) == 0.0 for v in aux.values())


@pytest.mark.parametrize("fn", [losses.ppo_clip, losses.gspo, losses.gspo_token, losses.cispo,
                                losses.gmpo])
def test_surrogates_are_finite_with_nan_and_inf_at_padding(fn):
    learner = _row([-1.0, jnp.nan, jnp.inf, -1e30])
    old = _row([-1.2, jnp.inf, jnp.nan, 1e30])
    adv = _row([1.0, jnp.nan, jnp.inf, 1e30])
    mask = _row([1, 0, 0, 0])
    tok, aux, g = _sum_value_and_grad(fn, learner, old, adv, mask)
    assert np.all(np.isfinite(tok)) and np.all(np.isfinite(g))
    np.testing.assert_array_equal(tok[0, 1:], 0.0)
    np.testing.assert_array_equal(g[0, 1:], 0.0)
