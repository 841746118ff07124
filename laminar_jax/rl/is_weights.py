"""Behaviour importance weights: TIS, masked IS / IcePop, V-trace, TOPR.

All weights are constants of the loss (stop-gradient) built from the behaviour log-ratio
lambda_t = log(pi_old / mu)_t: `pi_old` is the trainer's proximal recompute (decoupled mode) or
`sg(learner)` (bypass mode), `mu` the engine's behaviour log-prob (`behaviour_log_ratio`).
Weights are 1 at masked positions (neutral; the loss mask removes those tokens anyway).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from laminar_jax.rl.seq_ops import (LOG_RATIO_BOUND, SeqView, log_ratio, last_valid, safe_exp,
                                    seq_gather, seq_mean, seq_sum, suffix_sum)

LEVELS = ("token", "sequence", "geometric")


def behaviour_log_ratio(old_logp: chex.Array, behaviour_logp: chex.Array,
                        mask: chex.Array) -> jax.Array:
    """lambda = sg(l_old - l_mu), fp32, clamped to +-20, 0 at masked positions (corrections.md s1).

    Pass `prox_logp` as `old_logp` in decoupled mode and `learner_logp` in bypass mode (it is
    detached here): without a recompute the ratio must come from the engine log-probs, else the
    engine mismatch is silently ignored (verl rollout_corr_math.md section 3.7).
    """
    chex.assert_equal_shape([old_logp, behaviour_logp, mask],
                            custom_message="rl.is_weights.behaviour_log_ratio: old/behaviour/mask")
    return jax.lax.stop_gradient(log_ratio(old_logp, behaviour_logp, mask))


def level_log_stat(log_rho: chex.Array, mask: chex.Array, view: SeqView, level: str) -> jax.Array:
    """Per-token log statistic: 'token' lambda_t, 'sequence' sum_t lambda (log of the product
    ratio), 'geometric' mean_t lambda (log of the geometric-mean ratio), broadcast to tokens."""
    if level == "token":
        return log_rho
    if level == "sequence":
        s = seq_gather(seq_sum(log_rho * mask, view), view)
    elif level == "geometric":
        s = seq_gather(seq_mean(log_rho, mask, view)[0], view)
    else:
        raise ValueError(f"rl.is_weights: level={level!r}; expected one of {LEVELS}")
    return jnp.clip(s, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def importance_weights(log_rho: chex.Array, mask: chex.Array, view: SeqView, *,
                       level: str = "token", mode: str = "truncate", is_min: float = 0.0,
                       is_max: float | None = 2.0) -> tuple[jax.Array, jax.Array]:
    """Truncated or masked importance weights; returns `(weight, raw_weight)`.

    w = exp(stat) with stat from `level_log_stat`, then
      mode 'truncate' (TIS, Yao et al. 2025, https://fengyao.notion.site/off-policy-rl):
        clip(w, is_min, is_max);
      mode 'mask' (masked IS; at token level with [0.5, 5] this is IcePop, Ant Group Ling team
        2025; TRL token_mask / sequence_mask): w * 1[is_min <= w <= is_max].
    `is_max=None` means no upper bound. verl: 'sequence' truncate = decoupled_seq_is.
    """
    chex.assert_equal_shape([log_rho, mask], custom_message="rl.is_weights: log_rho/mask")
    stat = level_log_stat(log_rho, mask, view, level)
    raw = safe_exp(stat)
    hi = jnp.inf if is_max is None else is_max
    if mode == "truncate":
        w = jnp.clip(raw, is_min, hi)
    elif mode == "mask":
        w = jnp.where((raw >= is_min) & (raw <= hi), raw, 0.0)
    else:
        raise ValueError(f"rl.is_weights: mode={mode!r}; expected 'truncate' or 'mask'")
    valid = mask > 0
    return (jax.lax.stop_gradient(jnp.where(valid, w, 1.0)),
            jax.lax.stop_gradient(jnp.where(valid, raw, 1.0)))


def vtrace_weights(log_rho: chex.Array, mask: chex.Array, view: SeqView, *,
                   rho_bar: float = 1.0, c_bar: float = 1.0) -> jax.Array:
    """V-trace policy-gradient weights for a terminal reward (IMPALA, arXiv 1802.01561).

    rho_t = min(rho_bar, pi/mu), c_t = min(c_bar, pi/mu). With gamma = lambda = 1, V = 0 and one
    reward at the last valid token T, the V-trace PG advantage at token s is w_s * R with
      w_s = rho_s * prod_{s<j<T} c_j * rho_T   (s < T),     w_T = rho_T,
    so the loss uses w_s * A_s with the sequence advantage in place of R (corrections.md 5.6).
    Masked tokens (tool output) inside a sequence count as rho = c = 1.
    """
    chex.assert_equal_shape([log_rho, mask], custom_message="rl.is_weights.vtrace: log_rho/mask")
    m = mask
    log_r = jnp.minimum(jnp.log(rho_bar), log_rho) * m
    log_c = jnp.minimum(jnp.log(c_bar), log_rho) * m
    last = last_valid(m, view)
    log_r_last = seq_gather(seq_sum(log_r * last, view), view)
    log_c_last = seq_gather(seq_sum(log_c * last, view), view)
    between = suffix_sum(log_c, view) - log_c_last
    log_w = jnp.where(last > 0, log_r, log_r + between + log_r_last)
    w = safe_exp(log_w)
    return jax.lax.stop_gradient(jnp.where(m > 0, w, 1.0))


def topr_weights(log_rho: chex.Array, advantages: chex.Array, mask: chex.Array,
                 view: SeqView) -> jax.Array:
    """TOPR, tapered off-policy REINFORCE (Le Roux et al., arXiv 2503.14286).

    Per sequence: w_i = 1 if A_i >= 0 else clip(pi(y_i) / mu(y_i), 0, 1), with
    log pi(y)/mu(y) = sum_t lambda_t and A_i the sequence mean advantage. Pair with the
    'reinforce' surrogate for the paper's estimator.
    """
    chex.assert_equal_shape([log_rho, advantages, mask],
                            custom_message="rl.is_weights.topr: log_rho/advantages/mask")
    seq_log = seq_sum(log_rho * mask, view)
    seq_adv = seq_mean(advantages, mask, view)[0]
    w_i = jnp.where(seq_adv >= 0, 1.0, safe_exp(jnp.minimum(seq_log, 0.0)))
    return jax.lax.stop_gradient(jnp.where(mask > 0, seq_gather(w_i, view), 1.0))
