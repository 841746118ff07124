"""KL estimators (Schulman, http://joschu.net/blog/kl-approx.html) and the entropy of the policy.

With x = l_ref - l (l = learner log-prob, fp32, clamped to +-20, 0 at padding), per token:

| estimator | value              | d/dl       | note |
|-----------|--------------------|------------|------|
| k1        | -x = l - l_ref     | 1          | unbiased value, zero expected gradient on-policy |
| k2        | x^2 / 2            | l - l_ref  | expected gradient = grad KL(pi || ref) |
| k3        | exp(x) - x - 1     | 1 - exp(x) | unbiased, low variance, >= 0 (GRPO's KL, arXiv 2402.03300) |
| k3_plus   | value of k3        | l - l_ref  | verl's straight-through k2 - sg(k2) + sg(k3) |
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from laminar_jax.rl.seq_ops import as_mask, log_ratio, masked

KL_ESTIMATORS = ("k1", "k2", "k3", "k3_plus")


def kl_penalty(learner_logp: chex.Array, ref_logp: chex.Array, mask: chex.Array, *,
               estimator: str = "k3") -> jax.Array:
    """Per-token estimate `[B, T]` of KL(pi_learner || pi_ref) (table in the module docstring).

    Gradients flow only through `learner_logp`; `ref_logp` is a constant.
    """
    chex.assert_rank([learner_logp, ref_logp, mask], 2)
    chex.assert_equal_shape([learner_logp, ref_logp, mask],
                            custom_message="rl.kl.kl_penalty: learner_logp/ref_logp/mask")
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"rl.kl.kl_penalty: estimator={estimator!r}; expected one of "
                         f"{KL_ESTIMATORS}")
    m = as_mask(mask)
    x = log_ratio(jax.lax.stop_gradient(ref_logp), learner_logp, m)
    k2 = 0.5 * jnp.square(x)
    k3 = jnp.expm1(x) - x  # exp(x) - 1 - x without cancellation for small x
    if estimator == "k1":
        value = -x
    elif estimator == "k2":
        value = k2
    elif estimator == "k3":
        value = k3
    else:
        value = k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(k3)
    return masked(value, m)


def entropy_from_logits(logits: chex.Array) -> jax.Array:
    """Token entropy H = -sum_v p_v log p_v of the softmax of `logits` `[..., V]`, in fp32.

    The result drops the last axis. Entries with p = 0 (logit -inf) contribute 0, with no NaN in
    the value or the gradient. The entropy bonus of the loss (corrections.md section 4.9) takes
    this per-token array as `entropy=`.
    """
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    p = jnp.exp(logp)
    return -jnp.sum(p * jnp.where(p > 0, logp, 0.0), axis=-1)
