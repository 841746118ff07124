"""Training-inference mismatch: how far the engine's log-probs are from the learner's on the
tokens the engine sampled (corrections.md section 7; arXiv 2605.14220).

With l_b the behaviour (engine) log-prob, l the learner's, delta = l - l_b per token (fp32,
clamped to +-20, 0 where masked) and r = exp(delta) = pi / mu, averaged over the valid tokens
(tokens sampled from mu, so each mean estimates an expectation under mu):

| key       | value                   | estimates                                   |
|-----------|-------------------------|---------------------------------------------|
| abs_mean  | mean abs(delta)         |                                             |
| abs_max   | max abs(delta)          |                                             |
| k1        | mean(-delta)            | KL(mu || pi), unbiased, can be negative     |
| k3        | mean(r - 1 - delta)     | KL(mu || pi), unbiased, >= 0 per token      |
| chi2      | mean((r - 1)^2)         | chi^2(pi || mu) = E_mu[r^2] - 1             |
| num_tokens| number of valid tokens  |                                             |

The keys never change; with no valid token every value is 0. Pure: arrays in, dict out.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from laminar_jax.rl.seq_ops import as_mask, log_ratio, masked_max, masked_mean

MISMATCH_KEYS = ("abs_mean", "abs_max", "k1", "k3", "chi2", "num_tokens")


def mismatch_metrics(learner_logp: chex.Array, behaviour_logp: chex.Array,
                     mask: chex.Array) -> dict[str, jax.Array]:
    """The table of the module docstring, for `[B, T]` arrays (detached, fp32 scalars)."""
    chex.assert_rank([learner_logp, behaviour_logp, mask], 2)
    chex.assert_equal_shape([learner_logp, behaviour_logp, mask],
                            custom_message="rl.mismatch.mismatch_metrics: learner_logp/behaviour_logp/mask")
    sg = jax.lax.stop_gradient
    m = as_mask(mask)
    d = log_ratio(sg(learner_logp), sg(behaviour_logp), m)
    em1 = jnp.expm1(d)  # r - 1 without cancellation for small delta
    out = {
        "abs_mean": masked_mean(jnp.abs(d), m),
        "abs_max": masked_max(jnp.abs(d), m),
        "k1": masked_mean(-d, m),
        "k3": masked_mean(em1 - d, m),
        "chi2": masked_mean(jnp.square(em1), m),
        "num_tokens": jnp.sum(m),
    }
    return {k: jnp.asarray(out[k], jnp.float32) for k in MISMATCH_KEYS}
