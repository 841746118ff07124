"""KL estimators and entropy: closed-form values and gradients."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.rl.kl import entropy_from_logits, kl_penalty

X = -0.5  # x = l_ref - l with l = -1, l_ref = -1.5
CASES = {
    "k1": (0.5, 1.0),
    "k2": (0.125, 0.5),
    "k3": (math.exp(X) - X - 1, 1 - math.exp(X)),
    "k3_plus": (math.exp(X) - X - 1, 0.5),
}


@pytest.mark.parametrize("estimator", sorted(CASES))
def test_kl_estimator_value_and_gradient(estimator):
    value, grad = CASES[estimator]
    learner = jnp.asarray([[-1.0, 3.0]])
    ref = jnp.asarray([[-1.5, jnp.nan]])
    mask = jnp.asarray([[1.0, 0.0]])
    f = lambda x: jnp.sum(kl_penalty(x, ref, mask, estimator=estimator))
    v, g = jax.value_and_grad(f)(learner)
    np.testing.assert_allclose(v, value, rtol=1e-6)
    np.testing.assert_allclose(g, [[grad, 0.0]], rtol=1e-6)
    # ref_logp carries no gradient
    g_ref = jax.grad(lambda r: jnp.sum(kl_penalty(learner, r, mask, estimator=estimator)))(ref)
    np.testing.assert_array_equal(g_ref, 0.0)


def test_k3_is_nonnegative_and_zero_on_policy():
    key = jax.random.PRNGKey(0)
    a, b = -jax.random.uniform(key, (4, 6)) * 3, -jax.random.uniform(jax.random.PRNGKey(1), (4, 6))
    m = jnp.ones((4, 6))
    assert float(jnp.min(kl_penalty(a, b, m, estimator="k3"))) >= 0.0
    for est in CASES:
        np.testing.assert_array_equal(kl_penalty(a, a, m, estimator=est), 0.0)


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="estimator='k4'"):
        kl_penalty(jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.ones((1, 1)), estimator="k4")


def test_entropy_from_logits():
    np.testing.assert_allclose(entropy_from_logits(jnp.zeros((2, 3, 4))), math.log(4), rtol=1e-6)
    z = jax.random.normal(jax.random.PRNGKey(2), (3, 7)) * 2
    p = np.exp(np.asarray(z, np.float64))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(entropy_from_logits(z), -(p * np.log(p)).sum(-1), rtol=1e-5)
    # banned vocabulary entries (-inf logits) contribute nothing and give no NaN gradient
    z = jnp.asarray([[0.0, -jnp.inf, 0.0]])
    np.testing.assert_allclose(entropy_from_logits(z), [math.log(2)], rtol=1e-6)
    g = jax.grad(lambda x: jnp.sum(entropy_from_logits(x)))(jnp.asarray([[0.3, -jnp.inf, -0.2]]))
    assert np.all(np.isfinite(g))
