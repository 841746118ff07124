"""Off-policy and staleness corrections composed from a `CorrectionSpec`.

Stage (a) of the loss (corrections.md section 8): from the log-probs, advantages and staleness,
build a detached per-token weight `w` and keep mask `k`; the loss is then
`agg(k * w * surrogate(learner, old))`. Every option is the identity when the learner, proximal
and behaviour log-probs are equal and nothing is stale (with vtrace bars >= 1).

The PPO anchor ("old"): `spec.old == 'behaviour'` is bypass mode (old = mu, no recompute; verl
bypass_mode, slime --use-rollout-logprobs); `'prox'` is decoupled mode (old = the trainer's
recompute at consumption time; with a behaviour weight pi_prox / mu this is decoupled PPO,
Hilton et al. arXiv 2110.00641, AReaL arXiv 2505.24298).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from laminar_jax.rl.is_weights import (behaviour_log_ratio, importance_weights, topr_weights,
                                       vtrace_weights)
from laminar_jax.rl.off_policy_masks import m2po_mask, opsm_mask, rejection_mask
from laminar_jax.rl.seq_ops import SeqView, as_mask
from laminar_jax.rl.spec import CorrectionSpec
from laminar_jax.rl.staleness import staleness_decay_weights, staleness_keep


def old_logp_for(spec: CorrectionSpec, *, behaviour_logp, prox_logp):
    """The PPO anchor log-probs the spec selects (constant). 'prox' and 'ewma' both read
    `prox_logp`: the learner recomputes it with its current weights or with their EWMA."""
    if spec.old in ("prox", "ewma"):
        if prox_logp is None:
            raise ValueError(f"rl.corrections: prox_logp is None but correction.old="
                             f"{spec.old!r} needs the trainer's recompute (LossSpec.needs_prox)")
        return jax.lax.stop_gradient(prox_logp)
    return jax.lax.stop_gradient(behaviour_logp)


def apply_corrections(spec: CorrectionSpec, *, learner_logp: chex.Array,
                      behaviour_logp: chex.Array, prox_logp: chex.Array | None,
                      advantages: chex.Array, mask: chex.Array, staleness: chex.Array,
                      view: SeqView) -> tuple[jax.Array, jax.Array, dict]:
    """Returns `(weight, keep, aux)`, all `[B, T]` and detached.

    `mask` is the 0/1 loss mask, `staleness` per-token float (`staleness.staleness_per_token`),
    `view` the sequence view of the batch. `aux` holds `log_rho` (the behaviour log-ratio the
    weights and masks are built from) and `is_weight_raw` (the untruncated IS weight, 1 when
    `is_level` is 'none') and `is_clipped` (1 where the TIS truncation or the IS mask changed
    the weight: raw weight outside [is_min, is_max]; 0 when `is_level` is 'none').
    """
    mask = as_mask(mask)
    # bypass: the ratio to mu comes from the (detached) learner, not from a recompute
    old = old_logp_for(spec, behaviour_logp=behaviour_logp, prox_logp=prox_logp)
    if spec.old == "behaviour":
        old = learner_logp
    log_rho = behaviour_log_ratio(old, behaviour_logp, mask)
    ones = jnp.ones_like(mask)
    weight, keep, raw = ones, ones, ones
    is_clipped = jnp.zeros_like(mask)

    if spec.is_level != "none":
        w, raw = importance_weights(log_rho, mask, view, level=spec.is_level, mode=spec.is_mode,
                                    is_min=spec.is_min, is_max=spec.is_max)
        weight = weight * w
        hi = jnp.inf if spec.is_max is None else spec.is_max
        is_clipped = jnp.where((mask > 0) & ((raw < spec.is_min) | (raw > hi)), 1.0, 0.0)
    if spec.vtrace:
        weight = weight * vtrace_weights(log_rho, mask, view, rho_bar=spec.vtrace_rho_bar,
                                         c_bar=spec.vtrace_c_bar)
    if spec.topr:
        weight = weight * topr_weights(log_rho, advantages, mask, view)
    if spec.staleness_decay is not None:
        weight = weight * staleness_decay_weights(staleness, mask, decay=spec.staleness_decay)

    if spec.reject_level != "none":
        keep = keep * rejection_mask(log_rho, mask, view, level=spec.reject_level,
                                     low=spec.reject_low, high=spec.reject_high)
    if spec.opsm_delta is not None:
        keep = keep * opsm_mask(learner_logp, behaviour_logp, advantages, mask, view,
                                delta=spec.opsm_delta)
    if spec.m2po_tau is not None:
        keep = keep * m2po_mask(log_rho, mask, tau=spec.m2po_tau)
    if spec.max_staleness is not None:
        keep = keep * staleness_keep(staleness, mask, max_staleness=spec.max_staleness)

    aux = {"log_rho": log_rho, "is_weight_raw": raw,
           "is_clipped": jax.lax.stop_gradient(is_clipped)}
    return jax.lax.stop_gradient(weight), jax.lax.stop_gradient(keep), aux
