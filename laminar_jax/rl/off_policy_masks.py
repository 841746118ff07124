"""Rejection masks: masked IS / rejection sampling, OPSM, M2PO.

Each returns a detached float `keep` array `[B, T]` (1 = token stays in the loss; 1 at masked
positions). `log_rho` is the behaviour log-ratio of `is_weights.behaviour_log_ratio`.
Whether rejected tokens stay in the loss denominator is `AggregationSpec.rejected_in_denominator`.
"""
from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp

from laminar_jax.rl.is_weights import level_log_stat
from laminar_jax.rl.seq_ops import SeqView, as_mask, seq_gather, seq_mean


def _keep(cond: jax.Array, mask: chex.Array) -> jax.Array:
    return jax.lax.stop_gradient(jnp.where(mask > 0, cond.astype(jnp.float32), 1.0))


def rejection_mask(log_rho: chex.Array, mask: chex.Array, view: SeqView, *,
                   level: str = "token", low: float = 0.5, high: float | None = 2.0) -> jax.Array:
    """Keep tokens whose ratio statistic lies in [low, high] (compared in log space).

    level 'token': rho_t (token MIS / RS); 'sequence': prod_t rho_t (Seq-MIS, verl
    `seq_sum_k1`); 'geometric': exp(mean_t log rho_t) (Geo-RS, verl `seq_mean_k1`, e.g.
    [0.999, 1.001]). Sources: Liu, Li et al. 2025 "When Speed Kills Stability"
    (https://richardli.xyz/rl-collapse); Trust Region Masking, arXiv 2512.23075. The bounds are
    on the ratio pi_old / mu itself (verl's k1 code accepts [1/high, 1/low]; corrections.md s10.1).
    `high=None` means no upper bound.
    """
    chex.assert_equal_shape([log_rho, mask], custom_message="rl.off_policy_masks: log_rho/mask")
    stat = level_log_stat(log_rho, mask, view, level)
    lo = -jnp.inf if low <= 0 else math.log(low)
    hi = jnp.inf if high is None else math.log(high)
    return _keep((stat >= lo) & (stat <= hi), mask)


def opsm_mask(learner_logp: chex.Array, behaviour_logp: chex.Array, advantages: chex.Array,
              mask: chex.Array, view: SeqView, *, delta: float) -> jax.Array:
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556).

    Drop sequence i when A_i < 0 and (1/|y_i|) sum_t (l_mu - sg(l_learner)) > delta: negative
    samples that drifted too far from the current policy. A_i = sequence mean advantage.
    """
    chex.assert_equal_shape([learner_logp, behaviour_logp, advantages, mask],
                            custom_message="rl.off_policy_masks.opsm: learner/behaviour/adv/mask")
    m = as_mask(mask)
    diff = jnp.asarray(behaviour_logp, jnp.float32) - jax.lax.stop_gradient(
        jnp.asarray(learner_logp, jnp.float32))
    diff = jnp.where((m > 0) & jnp.isfinite(diff), diff, 0.0)
    drift_i = seq_mean(diff, m, view)[0]
    adv_i = seq_mean(advantages, m, view)[0]
    drop_i = (adv_i < 0) & (drift_i > delta)
    return _keep(~seq_gather(drop_i, view), m)


def m2po_mask(log_rho: chex.Array, mask: chex.Array, *, tau: float) -> jax.Array:
    """M2PO second-moment mask (Zheng, Zhao, Chen 2025, arXiv 2510.01161).

    Over the valid tokens passed in, sort (log w)^2 largest first and mask the shortest prefix
    after which the mean of the remaining tokens is < tau (AReaL `m2_threshold`, e.g. 0.04).
    The mask depends on the whole batch: pass the whole mini-batch (or run it on the mini-batch
    first, in decoupled mode where lambda is a constant) for micro-batch-exact results.
    """
    chex.assert_equal_shape([log_rho, mask], custom_message="rl.m2po_mask: log_rho/mask")
    m = jnp.ravel(mask) > 0
    n = m.shape[0]
    v = jnp.where(m, jnp.square(jnp.ravel(log_rho).astype(jnp.float32)), 0.0)
    order = jnp.argsort(jnp.where(m, -v, jnp.inf), stable=True)
    sv = v[order]
    count = jnp.sum(m)
    dropped = jnp.cumsum(sv) - sv  # sum of the k values before position k
    remaining = count - jnp.arange(n)
    mean_rest = jnp.where(remaining > 0, (jnp.sum(sv) - dropped) / jnp.maximum(remaining, 1), 0.0)
    ok = jnp.concatenate([mean_rest < tau, jnp.ones((1,), bool)])
    k_star = jnp.argmax(ok)
    keep_sorted = jnp.arange(n) >= k_star
    keep = jnp.zeros((n,), bool).at[order].set(keep_sorted)
    return _keep(keep.reshape(jnp.shape(mask)), jnp.asarray(mask))
