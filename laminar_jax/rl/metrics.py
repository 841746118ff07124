"""Loss metrics with a fixed set of keys, whatever options are on (the jitted step never changes
structure). Definitions follow corrections.md section 7. All values are detached; means are over
the valid tokens (or sequences) of this call, so average them over micro-batches (counts are
given as `num_*`; maxima and minima combine with max / min; the histogram with a sum).

| key | definition |
|-----|------------|
| clip_frac_low / _high / _dual | fraction of the tokens in the loss whose clip branch removed the gradient |
| approx_kl | k3 policy drift: mean(r - 1 - log r), r = pi_learner / pi_old (tokens from pi_old) |
| is_weight_mean / _min / _max | the combined correction weight w over valid tokens |
| is_weight_raw_max | the untruncated IS weight's max (1 when is_level is 'none') |
| tis_clip_frac | fraction of valid tokens whose raw IS weight lies outside [is_min, is_max] (truncated by TIS or zeroed by the IS mask; 0 when is_level is 'none') |
| ess | effective sample size (sum w k)^2 / (N sum (w k)^2) of the kept weights, in (0, 1] |
| masked_frac / masked_seq_frac | fraction of valid tokens / sequences (any token) out of the loss, by a rejection mask or by a zero weight (IcePop / masked IS) |
| mismatch_abs_mean / _max / _k1 / _k3 / _chi2 | `rl.mismatch.mismatch_metrics(l_learner, l_behaviour)`: abs(delta) mean and max, k1 and k3 KL(mu \|\| pi), chi^2(pi \|\| mu) |
| ppl_ratio | mean_i exp(mean_t l_behaviour - mean_t l_learner) (verl ppl_ratio) |
| staleness_hist / _mean / _max | sequences per staleness bin (last bin open), mean, max |
| num_tokens / num_kept_tokens / num_seqs | local counts (kept = in the loss with a non-zero weight) |
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from laminar_jax.rl.mismatch import mismatch_metrics
from laminar_jax.rl.seq_ops import (SeqView, log_ratio, masked_max, masked_mean, masked_min,
                                    safe_exp, seq_mean, seq_sum)
from laminar_jax.rl.staleness import staleness_histogram

METRIC_KEYS = (
    "loss", "pg_loss", "kl_loss", "kl_ref", "entropy",
    "clip_frac_low", "clip_frac_high", "clip_frac_dual", "approx_kl",
    "is_weight_mean", "is_weight_min", "is_weight_max", "is_weight_raw_max", "tis_clip_frac",
    "ess", "masked_frac", "masked_seq_frac",
    "mismatch_abs_mean", "mismatch_abs_max", "mismatch_k1", "mismatch_k3", "mismatch_chi2",
    "ppl_ratio",
    "staleness_hist", "staleness_mean", "staleness_max",
    "num_tokens", "num_kept_tokens", "num_seqs",
)


def effective_sample_size(weights: jax.Array, mask: jax.Array) -> jax.Array:
    """ESS = (sum w)^2 / (N sum w^2) over valid entries (verl rollout_is_eff_sample_size, VCPO);
    1 for equal weights, 0 when every weight is 0 or nothing is valid."""
    w = jnp.where(mask > 0, weights, 0.0)
    n = jnp.sum(mask)
    den = n * jnp.sum(jnp.square(w))
    return jnp.where(den > 0, jnp.square(jnp.sum(w)) / jnp.maximum(den, 1e-30), 0.0)


def loss_metrics(*, mask, keep, weight, is_weight_raw, learner_logp, old_logp, behaviour_logp,
                 clip_aux: dict, staleness, view: SeqView, staleness_bins: int,
                 is_clipped=None) -> dict:
    """Metrics of one loss call (table in the module docstring); keys from `METRIC_KEYS` minus
    the loss terms, which `compose` adds. `is_clipped`: 1 where the IS truncation / mask acted
    (`corrections.apply_corrections` aux), None = nowhere."""
    sg = jax.lax.stop_gradient
    learner_logp = sg(learner_logp)
    # a token is out of the loss when a mask rejects it or its weight is 0 (IcePop zeroes w)
    in_loss = mask * keep * (weight != 0)
    d = log_ratio(learner_logp, old_logp, mask)  # log r, r = pi / pi_old
    mismatch = log_ratio(learner_logp, behaviour_logp, mask)
    mm = mismatch_metrics(learner_logp, behaviour_logp, mask)
    seq_diff = seq_mean(-mismatch, mask, view)[0]
    seq_valid = (seq_sum(mask, view) > 0).astype(jnp.float32)
    seq_rejected = seq_sum(mask - in_loss, view) > 0
    if is_clipped is None:
        is_clipped = jnp.zeros_like(mask)
    n_seq = jnp.maximum(jnp.sum(seq_valid), 1.0)
    hist, k_mean, k_max = staleness_histogram(staleness, mask, view, bins=staleness_bins)
    out = {
        "clip_frac_low": masked_mean(clip_aux["clipped_low"], in_loss),
        "clip_frac_high": masked_mean(clip_aux["clipped_high"], in_loss),
        "clip_frac_dual": masked_mean(clip_aux["clipped_dual"], in_loss),
        "approx_kl": masked_mean(jnp.expm1(d) - d, mask),
        "is_weight_mean": masked_mean(weight, mask),
        "is_weight_min": masked_min(weight, mask),
        "is_weight_max": masked_max(weight, mask),
        "is_weight_raw_max": masked_max(is_weight_raw, mask),
        "tis_clip_frac": masked_mean(is_clipped, mask),
        "ess": effective_sample_size(weight * keep, mask),
        "masked_frac": masked_mean(mask - in_loss, mask),
        "masked_seq_frac": jnp.sum(seq_rejected * seq_valid) / n_seq,
        **{f"mismatch_{k}": mm[k] for k in ("abs_mean", "abs_max", "k1", "k3", "chi2")},
        "ppl_ratio": jnp.sum(safe_exp(seq_diff) * seq_valid) / n_seq,
        "staleness_hist": hist,
        "staleness_mean": k_mean,
        "staleness_max": k_max,
        "num_tokens": jnp.sum(mask),
        "num_kept_tokens": jnp.sum(in_loss),
        "num_seqs": jnp.sum(seq_valid),
    }
    return {k: sg(jnp.asarray(v, jnp.float32)) for k, v in out.items()}
