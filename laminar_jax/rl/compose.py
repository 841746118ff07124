"""One loss from a `LossSpec`: correction x surrogate x aggregation (+ KL, entropy).

    total = agg(k * w * L_surrogate(l_learner, l_old, A))
            + kl.coef * agg(k(l_learner, l_ref)) - entropy_coef * agg(H)

with `w, k` the detached weight and keep mask of `corrections.apply_corrections`, `l_old` the
anchor the correction spec selects, and every `agg` the spec's aggregation over the kept tokens
with one normaliser (rejected tokens stay in its denominator unless
`aggregation.rejected_in_denominator` is False). An ablation is a change of spec, not of code;
docs/corrections.md lists every config name.
"""
from __future__ import annotations

from typing import Callable

import chex
import jax
import jax.numpy as jnp

from laminar_jax.rl import losses
from laminar_jax.rl.aggregation import aggregate, local_normaliser
from laminar_jax.rl.corrections import apply_corrections, old_logp_for
from laminar_jax.rl.kl import kl_penalty
from laminar_jax.rl.metrics import loss_metrics
from laminar_jax.rl.seq_ops import as_mask, check_token_array, masked, seq_view
from laminar_jax.rl.spec import LossSpec
from laminar_jax.rl.staleness import staleness_per_token

LossFn = Callable[..., tuple[jax.Array, dict]]


def loss_normaliser(spec: LossSpec, mask: chex.Array, *, segment_ids: chex.Array | None = None,
                    max_segments: int | None = None,
                    keep_mask: chex.Array | None = None) -> jax.Array:
    """This micro-batch's share of the loss normaliser; pass the sum of all shares of the
    optimiser step (micro-batches and devices) as `normaliser=` to every loss call.

    With `aggregation.rejected_in_denominator=False` the denominator counts only kept tokens:
    pass `keep_mask` (e.g. from `apply_corrections` on the mini-batch, in decoupled mode where it
    does not depend on the learner).
    """
    agg = spec.aggregation
    m = as_mask(mask, segment_ids)
    if not agg.rejected_in_denominator:
        if keep_mask is None:
            raise ValueError("rl.compose.loss_normaliser: keep_mask is None but "
                             "aggregation.rejected_in_denominator=False counts only kept tokens")
        m = m * (jnp.asarray(keep_mask) > 0)
    return local_normaliser(m, mode=agg.mode, norm_constant=agg.norm_constant,
                            segment_ids=segment_ids, max_segments=max_segments)


def keep_needs_learner(spec: LossSpec) -> bool:
    """The keep mask reads the learner's log-probs: OPSM always, and in bypass mode (where the
    behaviour log-ratio is sg(learner) - mu) rejection and M2PO."""
    c = spec.correction
    bypass_masks = c.reject_level != "none" or c.m2po_tau is not None
    return c.opsm_delta is not None or (c.old == "behaviour" and bypass_masks)


def kept_mask(spec: LossSpec, *, mask: chex.Array, behaviour_logp: chex.Array,
              advantages: chex.Array, learner_logp: chex.Array | None = None,
              prox_logp: chex.Array | None = None, staleness: chex.Array | None = None,
              segment_ids: chex.Array | None = None,
              max_segments: int | None = None) -> jax.Array:
    """`mask * keep` of the correction stage, as the loss will compute it: pass it as
    `keep_mask=` to `loss_normaliser` when `aggregation.rejected_in_denominator` is False.

    `learner_logp` (the current weights' log-probs, before the update) is needed only when
    `keep_needs_learner(spec)`; otherwise any array works and `prox_logp` is used for it.
    """
    m = as_mask(mask, segment_ids)
    if learner_logp is None:
        if keep_needs_learner(spec):
            raise ValueError("rl.compose.kept_mask: learner_logp is None but the keep mask of "
                             "this correction reads the learner (OPSM, or bypass rejection/M2PO)")
        learner_logp = behaviour_logp if prox_logp is None else prox_logp
    if spec.needs_prox and prox_logp is None:
        raise ValueError(f"rl.compose.kept_mask: prox_logp is None but correction.old="
                         f"{spec.correction.old!r} needs it")
    view = seq_view(m, segment_ids, max_segments)
    _, keep, _ = apply_corrections(
        spec.correction, learner_logp=learner_logp, behaviour_logp=behaviour_logp,
        prox_logp=prox_logp, advantages=jax.lax.stop_gradient(masked(advantages, m)), mask=m,
        staleness=staleness_per_token(staleness, m), view=view)
    return m * keep


def _surrogate(spec: LossSpec, learner_logp, old_logp, advantages, mask, seg_kw):
    s = spec.surrogate
    eps = {"eps_low": s.eps_low, "eps_high": s.eps_high}
    if s.kind == "ppo":
        return losses.ppo_clip(learner_logp, old_logp, advantages, mask, **eps,
                               dual_clip_c=s.dual_clip_c)
    if s.kind == "gspo":
        return losses.gspo(learner_logp, old_logp, advantages, mask, **eps, **seg_kw)
    if s.kind == "gspo_token":
        return losses.gspo_token(learner_logp, old_logp, advantages, mask, **eps, **seg_kw)
    if s.kind == "cispo":
        return losses.cispo(learner_logp, old_logp, advantages, mask, **eps)
    if s.kind == "gmpo":
        return losses.gmpo(learner_logp, old_logp, advantages, mask, **eps, **seg_kw)
    if s.kind == "sapo":
        return losses.sapo(learner_logp, old_logp, advantages, mask, tau_pos=s.sapo_tau_pos,
                           tau_neg=s.sapo_tau_neg)
    if s.kind == "dppo":
        return losses.dppo(learner_logp, old_logp, advantages, mask, **eps,
                           dual_clip_c=s.dual_clip_c)
    return losses.reinforce(learner_logp, advantages, mask)


def make_loss(spec: LossSpec) -> LossFn:
    """Build `loss_fn(learner_logp, *, behaviour_logp, advantages, mask, prox_logp=None,
    ref_logp=None, staleness=None, normaliser=None, entropy=None, segment_ids=None,
    max_segments=None) -> (loss, metrics)`.

    learner_logp `[B, T]` is the only differentiable input. prox_logp is required when
    `spec.needs_prox`, ref_logp when `spec.needs_ref`, entropy (per-token, from the learner's
    log-prob pass or `kl.entropy_from_logits`) when `spec.entropy_coef != 0`; without it the
    `entropy` metric is NaN (not measured). staleness: `[B]` or `[B, T]` versions
    of lag (None = 0). normaliser: the step's global normaliser (`loss_normaliser` shares summed);
    None uses this batch alone. segment_ids `[B, T]` for packed rows (contiguous segments, 0 =
    padding; ids above the static `max_segments`, default T, are merged). Metrics keys are
    `metrics.METRIC_KEYS` for every spec.
    """
    if not isinstance(spec, LossSpec):
        raise TypeError(f"rl.compose.make_loss: spec is {type(spec).__name__}; expected LossSpec")
    agg = spec.aggregation

    def loss_fn(learner_logp, *, behaviour_logp, advantages, mask, prox_logp=None, ref_logp=None,
                staleness=None, normaliser=None, entropy=None, segment_ids=None,
                max_segments=None):
        where = "rl.compose.loss_fn"
        chex.assert_rank(mask, 2, custom_message=f"{where}: mask")
        shape = tuple(jnp.shape(mask))
        check_token_array("learner_logp", learner_logp, shape, where)
        check_token_array("behaviour_logp", behaviour_logp, shape, where)
        check_token_array("advantages", advantages, shape, where)
        if spec.needs_prox:
            check_token_array("prox_logp (spec.needs_prox)", prox_logp, shape, where)
        if spec.needs_ref:
            check_token_array("ref_logp (spec.needs_ref)", ref_logp, shape, where)
        if spec.entropy_coef != 0:
            check_token_array("entropy (spec.entropy_coef != 0)", entropy, shape, where)
        if segment_ids is not None:
            check_token_array("segment_ids", segment_ids, shape, where)
            if staleness is not None and jnp.ndim(staleness) != 2:
                raise ValueError(f"{where}: staleness has shape {jnp.shape(staleness)} with "
                                 f"segment_ids; packed rows need per-token staleness {shape}")

        m = as_mask(mask, segment_ids)
        view = seq_view(m, segment_ids, max_segments)
        seg_kw = {"segment_ids": segment_ids, "max_segments": max_segments}
        adv = jax.lax.stop_gradient(masked(advantages, m))
        k_tok = staleness_per_token(staleness, m)
        old = old_logp_for(spec.correction, behaviour_logp=behaviour_logp, prox_logp=prox_logp)

        weight, keep, aux = apply_corrections(
            spec.correction, learner_logp=learner_logp, behaviour_logp=behaviour_logp,
            prox_logp=prox_logp, advantages=adv, mask=m, staleness=k_tok, view=view)
        loss_mask = m * keep
        token_loss, clip_aux = _surrogate(spec, learner_logp, old, adv, loss_mask, seg_kw)

        agg_kw = {"mode": agg.mode, "normaliser": normaliser, "norm_constant": agg.norm_constant,
                  "denominator_mask": m if agg.rejected_in_denominator else loss_mask, **seg_kw}
        pg_loss = aggregate(weight * token_loss, loss_mask, **agg_kw)
        zero = jnp.zeros((), jnp.float32)
        kl_loss, kl_ref, ent = zero, zero, jnp.full((), jnp.nan, jnp.float32)
        # given but unused (coef 0) inputs still feed the metrics
        if ref_logp is not None:
            check_token_array("ref_logp", ref_logp, shape, where)
            kl_tok = kl_penalty(learner_logp, ref_logp, loss_mask, estimator=spec.kl.estimator)
            kl_ref = aggregate(kl_tok, loss_mask, **agg_kw)
            kl_loss = spec.kl.coef * kl_ref
        if entropy is not None:
            check_token_array("entropy", entropy, shape, where)
            ent = aggregate(masked(entropy, loss_mask), loss_mask, **agg_kw)
        total = pg_loss + kl_loss
        if entropy is not None and spec.entropy_coef != 0:
            total = total - spec.entropy_coef * ent

        metrics = loss_metrics(
            mask=m, keep=keep, weight=weight, is_weight_raw=aux["is_weight_raw"],
            learner_logp=learner_logp, old_logp=old, behaviour_logp=behaviour_logp,
            clip_aux=clip_aux, staleness=k_tok, view=view, staleness_bins=spec.staleness_bins,
            is_clipped=aux["is_clipped"])
        sg = jax.lax.stop_gradient
        metrics.update(loss=sg(total), pg_loss=sg(pg_loss), kl_loss=sg(kl_loss),
                       kl_ref=sg(kl_ref), entropy=sg(ent))
        return total, metrics

    loss_fn.spec = spec
    return loss_fn
