"""Loss metrics with a fixed set of keys, whatever options are on (the jitted step never changes
structure). Definitions follow corrections.md section 7. All values are detached; means are over
the valid tokens (or sequences) of this call, so average them over micro-batches (counts are
given as `num_*`; maxima and minima combine with max / min; the histogram with a sum).

| key | definition |
|-----|------------|
| clip_frac_low / _high / _dual | fraction of loss tokens whose clip branch removed the gradient |
| approx_kl | k3 of learner vs old: mean(exp(x) - x - 1), x = l_old - l_learner |
| is_weight_mean / _min / _max | the combined correction weight w over valid tokens |
| is_weight_raw_max | the untruncated IS weight's max (1 when is_level is 'none') |
| ess | effective sample size (sum w k)^2 / (N sum (w k)^2) of the kept weights, in (0, 1] |
| masked_frac / masked_seq_frac | fraction of valid tokens / sequences (any token) rejected |
| mismatch_abs_mean / _max | mean and max of abs(l_learner - l_behaviour) |
| ppl_ratio | mean_i exp(mean_t l_behaviour - mean_t l_learner) (verl ppl_ratio) |
| staleness_hist / _mean / _max | sequences per staleness bin (last bin open), mean, max |
| num_tokens / num_kept_tokens / num_seqs | local counts |
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from laminar_jax.rl.seq_ops import (SeqView, log_ratio, masked_max, masked_mean, masked_min,
                                    safe_exp, seq_mean, seq_sum)
from laminar_jax.rl.staleness import staleness_histogram

METRIC_KEYS = (
    "loss", "pg_loss", "kl_loss", "kl_ref", "entropy",
    "clip_frac_low", "clip_frac_high", "clip_frac_dual", "approx_kl",
    "is_weight_mean", "is_weight_min", "is_weight_max", "is_weight_raw_max", "ess",
    "masked_frac", "masked_seq_frac", "mismatch_abs_mean", "mismatch_abs_max", "ppl_ratio",
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
                 clip_aux: dict, staleness, view: SeqView, staleness_bins: int) -> dict:
    """Metrics of one loss call (table in the module docstring); keys from `METRIC_KEYS` minus
    the loss terms, which `compose` adds."""
    sg = jax.lax.stop_gradient
    learner_logp = sg(learner_logp)
    loss_mask = mask * keep
    x = log_ratio(old_logp, learner_logp, mask)
    mismatch = log_ratio(learner_logp, behaviour_logp, mask)
    seq_diff = seq_mean(-mismatch, mask, view)[0]
    seq_valid = (seq_sum(mask, view) > 0).astype(jnp.float32)
    seq_rejected = seq_sum(mask * (1.0 - keep), view) > 0
    n_seq = jnp.maximum(jnp.sum(seq_valid), 1.0)
    hist, k_mean, k_max = staleness_histogram(staleness, mask, view, bins=staleness_bins)
    out = {
        "clip_frac_low": masked_mean(clip_aux["clipped_low"], loss_mask),
        "clip_frac_high": masked_mean(clip_aux["clipped_high"], loss_mask),
        "clip_frac_dual": masked_mean(clip_aux["clipped_dual"], loss_mask),
        "approx_kl": masked_mean(jnp.expm1(x) - x, mask),
        "is_weight_mean": masked_mean(weight, mask),
        "is_weight_min": masked_min(weight, mask),
        "is_weight_max": masked_max(weight, mask),
        "is_weight_raw_max": masked_max(is_weight_raw, mask),
        "ess": effective_sample_size(weight * keep, mask),
        "masked_frac": masked_mean(1.0 - keep, mask),
        "masked_seq_frac": jnp.sum(seq_rejected * seq_valid) / n_seq,
        "mismatch_abs_mean": masked_mean(jnp.abs(mismatch), mask),
        "mismatch_abs_max": masked_max(jnp.abs(mismatch), mask),
        "ppl_ratio": jnp.sum(safe_exp(seq_diff) * seq_valid) / n_seq,
        "staleness_hist": hist,
        "staleness_mean": k_mean,
        "staleness_max": k_max,
        "num_tokens": jnp.sum(mask),
        "num_kept_tokens": jnp.sum(loss_mask),
        "num_seqs": jnp.sum(seq_valid),
    }
    return {k: sg(jnp.asarray(v, jnp.float32)) for k, v in out.items()}
