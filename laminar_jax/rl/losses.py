"""Policy surrogates: per-token losses (to be minimised) and clip indicators.

Every function returns `(token_loss [B, T], aux)` where `aux` always holds the float 0/1 arrays
`clipped_low`, `clipped_high`, `clipped_dual` (tokens whose gradient a clip removed, or, for
CISPO, whose weight was truncated), so callers see the same structure for every surrogate.
Aggregate `token_loss` with `laminar_jax.rl.aggregation.aggregate`. Masked positions hold 0.

Notation: l = learner_logp (the only differentiable input), l_old = old_logp (the PPO anchor),
d = l - l_old (fp32, clamped to +-20, 0 at padding), r = exp(d), A = advantages.
Sequence-level surrogates use the masked sequence mean of A as the sequence advantage A_i.

The value returned is the value differentiated: `jax.grad` of the logged loss is the gradient
the update takes (CISPO and REINFORCE log -sg(w) A l, as verl and slime do). Every `exp` takes a
clamped log-ratio, and masked positions are replaced (`where`) before any arithmetic, so neither
the value nor the gradient can meet inf (no 0 * inf = NaN); where the clamp binds (|d| > 20) the
gradient of the clamped expression is 0.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from laminar_jax.rl.seq_ops import (as_mask, log_ratio, masked, safe_exp, seq_gather, seq_mean,
                                    seq_view)

GSPO_MAX_LOG_RATIO = 10.0  # verl clamps the sequence log-ratio at 10 before exp


def _prepare(learner_logp, old_logp, advantages, mask):
    chex.assert_rank([learner_logp, advantages, mask], 2)
    chex.assert_equal_shape([learner_logp, advantages, mask],
                            custom_message="rl.losses: learner_logp/advantages/mask")
    if old_logp is not None:
        chex.assert_equal_shape([learner_logp, old_logp],
                                custom_message="rl.losses: learner_logp/old_logp")
    m = as_mask(mask)
    adv = jax.lax.stop_gradient(masked(advantages, m))
    d = None if old_logp is None else log_ratio(learner_logp, jax.lax.stop_gradient(old_logp), m)
    return m, adv, d


def _aux(low=None, high=None, dual=None, like=None):
    z = jnp.zeros_like(like)
    return {"clipped_low": z if low is None else low.astype(jnp.float32),
            "clipped_high": z if high is None else high.astype(jnp.float32),
            "clipped_dual": z if dual is None else dual.astype(jnp.float32)}



def _dual_clip(loss, adv, m, c):
    """Dual-clip (Ye et al., arXiv 1912.09729): for A < 0, L = min(L, c |A|); (loss, capped tokens
    or None when c is None)."""
    if c is None:
        return loss, None
    cap = -adv * c
    return jnp.where(adv < 0, jnp.minimum(loss, cap), loss), (m > 0) & (adv < 0) & (loss > cap)

def _clipped_objective(ratio, adv, m, eps_low, eps_high):
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) and its low/high clip indicators."""
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(unclipped, clipped)
    low = (m > 0) & (adv < 0) & (ratio < 1.0 - eps_low)
    high = (m > 0) & (adv > 0) & (ratio > 1.0 + eps_high)
    return loss, low, high


def ppo_clip(learner_logp, old_logp, advantages, mask, *, eps_low: float = 0.2,
             eps_high: float = 0.2, dual_clip_c: float | None = None):
    """PPO clip, DAPO clip-higher and dual-clip.

    L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))   (PPO, arXiv 1707.06347; eps_low !=
    eps_high is DAPO's clip-higher, arXiv 2503.14476). Dual-clip (Ye et al., arXiv 1912.09729): for
    A < 0, L = min(L, c |A|), c > 1. dL/dl = -A r on the active unclipped branch, else 0.
    """
    m, adv, d = _prepare(learner_logp, old_logp, advantages, mask)
    loss, low, high = _clipped_objective(safe_exp(d), adv, m, eps_low, eps_high)
    loss, dual = _dual_clip(loss, adv, m, dual_clip_c)
    return masked(loss, m), _aux(low, high, dual, like=m)


def _sequence_log_ratio(d, adv, m, segment_ids, max_segments):
    view = seq_view(m, segment_ids, max_segments)
    seq_d, _ = seq_mean(d, m, view)
    seq_adv, _ = seq_mean(adv, m, view)
    return view, jnp.minimum(seq_d, GSPO_MAX_LOG_RATIO), seq_adv


def gspo(learner_logp, old_logp, advantages, mask, *, eps_low: float = 3e-4,
         eps_high: float = 4e-4, segment_ids=None, max_segments: int | None = None):
    """GSPO, sequence-level ratio (Zheng et al., arXiv 2507.18071).

    s_i = exp(mean_t d_{i,t}) (log clamped at 10), L_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low,
    1 + eps_high)), written to every valid token of sequence i; aggregate with
    'seq-mean-token-mean' for the paper's mean over sequences (dL/dl_{i,t} = -A_i s_i / |y_i|).
    """
    m, adv, d = _prepare(learner_logp, old_logp, advantages, mask)
    view, seq_d, seq_adv = _sequence_log_ratio(d, adv, m, segment_ids, max_segments)
    loss_i, low_i, high_i = _clipped_objective(safe_exp(seq_d), seq_adv, 1.0, eps_low, eps_high)
    low, high = seq_gather(low_i, view) & (m > 0), seq_gather(high_i, view) & (m > 0)
    return masked(seq_gather(loss_i, view), m), _aux(low, high, like=m)


def gspo_token(learner_logp, old_logp, advantages, mask, *, eps_low: float = 3e-4,
               eps_high: float = 4e-4, segment_ids=None, max_segments: int | None = None):
    """GSPO-token (arXiv 2507.18071, the form verl implements): per-token advantages allowed.

    s_{i,t} = sg(s_i) exp(l_{i,t} - sg(l_{i,t})), L_{i,t} = max(-A_{i,t} s_{i,t}, -A_{i,t}
    clip(s_{i,t}, 1 - eps_low, 1 + eps_high)). Value and gradient equal GSPO's when A is constant
    over each sequence.
    """
    m, adv, d = _prepare(learner_logp, old_logp, advantages, mask)
    view, seq_d, _ = _sequence_log_ratio(d, adv, m, segment_ids, max_segments)
    log_s = jax.lax.stop_gradient(seq_gather(seq_d, view)) + d - jax.lax.stop_gradient(d)
    loss, low, high = _clipped_objective(jnp.exp(log_s), adv, m, eps_low, eps_high)
    return masked(loss, m), _aux(low, high, like=m)


def cispo(learner_logp, old_logp, advantages, mask, *, eps_low: float = 1.0,
          eps_high: float = 0.28):
    """CISPO (MiniMax-M1, arXiv 2506.13585): clipped IS weight, every token keeps its gradient.

    r_hat = clip(r, 1 - eps_low, 1 + eps_high); L = -sg(r_hat) A l, the paper's loss: its value
    is the one differentiated (gradient -r_hat A). eps_low >= 1 disables the lower bound (the
    paper's setting); TRL's absolute cap min(r, C) is eps_low >= 1, eps_high = C - 1.
    """
    m, adv, d = _prepare(learner_logp, old_logp, advantages, mask)
    r = jax.lax.stop_gradient(safe_exp(d))
    r_hat = jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high)
    loss = -adv * r_hat * masked(learner_logp, m)
    low, high = (m > 0) & (r < 1.0 - eps_low), (m > 0) & (r > 1.0 + eps_high)
    return masked(loss, m), _aux(low, high, like=m)


def gmpo(learner_logp, old_logp, advantages, mask, *, eps_low: float = 0.4,
         eps_high: float = 0.4, segment_ids=None, max_segments: int | None = None):
    """GMPO, geometric-mean policy optimisation (Zhao et al., arXiv 2507.20673).

    d~_t = sgn(A_i) min(sgn(A_i) d_t, sgn(A_i) clip(d_t, -eps_low, eps_high)),
    L_i = -A_i exp(mean_t d~_t), written to every valid token; aggregate with
    'seq-mean-token-mean' for the paper's mean over sequences. eps bound the log-ratio.
    """
    m, adv, d = _prepare(learner_logp, old_logp, advantages, mask)
    view, _, seq_adv = _sequence_log_ratio(d, adv, m, segment_ids, max_segments)
    sign = jnp.sign(seq_gather(seq_adv, view))
    d_clip = sign * jnp.minimum(sign * d, sign * jnp.clip(d, -eps_low, eps_high))
    seq_log, _ = seq_mean(d_clip, m, view)
    loss_i = -seq_adv * safe_exp(seq_log)
    low = (m > 0) & (sign < 0) & (d < -eps_low)
    high = (m > 0) & (sign > 0) & (d > eps_high)
    return masked(seq_gather(loss_i, view), m), _aux(low, high, like=m)


def sapo(learner_logp, old_logp, advantages, mask, *, tau_pos: float = 1.0,
         tau_neg: float = 1.05):
    """SAPO, soft adaptive policy optimisation (Gao et al., Qwen, arXiv 2511.20347).

    L = -f(r) A with the soft gate f(r) = (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos if A > 0
    else tau_neg. dL/dl = -A r 4 s (1 - s), s = sigmoid(tau (r - 1)): equal to PPO's -A r at
    r = 1 and decaying smoothly away from it instead of a hard clip. The paper aggregates with
    'seq-mean-token-mean'. No clip indicator applies (all 0).
    """
    m, adv, d = _prepare(learner_logp, old_logp, advantages, mask)
    tau = jnp.where(adv > 0, tau_pos, tau_neg)
    loss = -adv * (4.0 / tau) * jax.nn.sigmoid(tau * (safe_exp(d) - 1.0))
    return masked(loss, m), _aux(like=m)


def dppo(learner_logp, old_logp, advantages, mask, *, eps_low: float = 0.2,
         eps_high: float = 0.2, dual_clip_c: float | None = None):
    """DPPO binary-TV trust region (arXiv 2602.04879; verl `dppo_tv`, prime-rl's default loss).

    The ratio clip is replaced by a mask on the probability difference p - p_old (p = exp(l)):
      v = 0 if (A > 0 and p - p_old > eps_high) or (A < 0 and p - p_old < -eps_low), else 1,
      L = -sg(v) A r            (dL/dl = -v A r).
    A token with A < 0 whose probability went up keeps its uncapped ratio (corrections.md
    section 10.5); `dual_clip_c` caps it as in dual-clip PPO: for A < 0, L = min(L, c |A|).
    With old = behaviour this is prime-rl's form (ratios against mu).
    """
    m, adv, d = _prepare(learner_logp, old_logp, advantages, mask)
    sg = jax.lax.stop_gradient
    dp = sg(jnp.exp(masked(learner_logp, m)) - jnp.exp(masked(old_logp, m)))
    high = (m > 0) & (adv > 0) & (dp > eps_high)
    low = (m > 0) & (adv < 0) & (dp < -eps_low)
    loss = jnp.where(high | low, 0.0, -adv * safe_exp(d))
    loss, dual = _dual_clip(loss, adv, m, dual_clip_c)
    return masked(loss, m), _aux(low, high, dual, like=m)


def reinforce(learner_logp, advantages, mask):
    """REINFORCE: L = -A l (gradient -A); the value is the one differentiated.

    With an IS weight from `corrections` this is verl's bypass `reinforce` loss,
    -sg(w) A l, and, with TOPR weights, TOPR (arXiv 2503.14286).
    """
    m, adv, _ = _prepare(learner_logp, None, advantages, mask)
    loss = -adv * masked(learner_logp, m)
    return masked(loss, m), _aux(like=m)
