"""PPO-EWMA tracker: closed-form recursion on a two-step SGD run, and the kept-mask helper."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from laminar_jax.rl.compose import keep_needs_learner, kept_mask
from laminar_jax.rl.ewma import ewma_params, ewma_tracker
from laminar_jax.rl.spec import CorrectionSpec, LossSpec


def test_ewma_tracker_closed_form():
    beta, lr = 0.6, 0.5
    tx = optax.chain(optax.sgd(lr), ewma_tracker(beta))
    p0 = {"w": jnp.asarray([1.0, -2.0])}
    state = tx.init(p0)
    np.testing.assert_array_equal(ewma_params(state)["w"], p0["w"])
    params = p0
    grads = [jnp.asarray([1.0, 1.0]), jnp.asarray([-2.0, 4.0])]
    for g in grads:
        updates, state = tx.update({"w": g}, state, params)
        params = optax.apply_updates(params, updates)
    p1 = p0["w"] - lr * grads[0]
    p2 = p1 - lr * grads[1]
    want = beta * (beta * p0["w"] + (1 - beta) * p1) + (1 - beta) * p2
    np.testing.assert_allclose(ewma_params(state)["w"], want, rtol=1e-6)
    np.testing.assert_allclose(params["w"], p2, rtol=1e-6)  # the updates are untouched
    with pytest.raises(ValueError, match="EWMA trackers"):
        ewma_params(optax.sgd(lr).init(p0))
    with pytest.raises(ValueError, match="decay=1.0"):
        ewma_tracker(1.0)


def test_kept_mask_matches_the_rejection_bounds():
    mask = jnp.asarray([[1.0, 1.0, 1.0, 0.0]])
    mu = jnp.asarray([[-1.0, -1.0, -1.0, -1.0]])
    prox = mu + jnp.log(jnp.asarray([[1.0, 3.0, 0.3, 9.0]]))
    spec = LossSpec(correction=CorrectionSpec(reject_level="token"))  # [0.5, 2]
    assert not keep_needs_learner(spec)
    np.testing.assert_array_equal(
        kept_mask(spec, mask=mask, behaviour_logp=mu, advantages=jnp.ones((1, 4)),
                  prox_logp=prox), [[1.0, 0.0, 0.0, 0.0]])
    bypass = LossSpec(correction=CorrectionSpec(old="behaviour", reject_level="token"))
    assert keep_needs_learner(bypass)
    with pytest.raises(ValueError, match="learner_logp is None"):
        kept_mask(bypass, mask=mask, behaviour_logp=mu, advantages=jnp.ones((1, 4)))
    np.testing.assert_array_equal(
        kept_mask(bypass, mask=mask, behaviour_logp=mu, advantages=jnp.ones((1, 4)),
                  learner_logp=prox), [[1.0, 0.0, 0.0, 0.0]])
