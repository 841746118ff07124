"""Group statistics and the DAPO reward-side tricks: dynamic-sampling filter and overlong shaping.

Source: DAPO, Yu et al. 2025, arXiv 2503.14476 (sections 3.2 "Dynamic Sampling" and 3.4
"Overlong Reward Shaping"); verl `algorithm.filter_groups` and `reward_manager/dapo.py`.

Groups are given by `group_ids: int [B]` with arbitrary ids in `[0, num_groups)` (not necessarily
contiguous, sorted or equal-sized) and a sequence mask `valid: bool [B]`. Every group reduction
is a segment reduction with a static `num_groups`, so the functions jit with fixed shapes.
Invalid (padding) sequences never enter a reduction: their rewards may be anything, NaN included,
and their group ids may be out of range.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

Array = chex.Array


def check_group_inputs(where: str, *, rewards: Array, group_ids: Array, valid: Array,
                       num_groups: int) -> None:
    """Raises ValueError naming `where` and the tensor when group inputs are malformed.

    Shapes are always checked. Id ranges are checked only when `group_ids` and `valid` are
    concrete (outside `jit`); inside `jit` out-of-range ids of valid sequences are dropped by the
    segment reductions, so check once eagerly upstream.
    """
    if not isinstance(num_groups, (int, np.integer)) or isinstance(num_groups, bool) \
            or num_groups < 1:
        raise ValueError(f"{where}: num_groups must be a static positive int, got {num_groups!r}")
    chex.assert_rank(rewards, 1, custom_message=f"{where}: rewards must be [B]",
                     exception_type=ValueError)
    chex.assert_equal_shape([rewards, group_ids, valid],
                            custom_message=f"{where}: rewards, group_ids, valid must all be [B]",
                            exception_type=ValueError)
    chex.assert_type(group_ids, int, custom_message=f"{where}: group_ids must be an int array",
                     exception_type=ValueError)
    if isinstance(group_ids, jax.core.Tracer) or isinstance(valid, jax.core.Tracer):
        return
    ids = np.asarray(group_ids)
    bad = np.asarray(valid).astype(bool) & ((ids < 0) | (ids >= num_groups))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{where}: group_ids[{i}] = {int(ids[i])} is outside [0, num_groups="
                         f"{num_groups}) for a valid sequence")


def safe_group_ids(group_ids: Array, valid: Array) -> Array:
    """Group ids with invalid sequences sent to group 0 (they carry zero weight there)."""
    return jnp.where(valid, group_ids, 0)


def as_float(x: Array) -> Array:
    x = jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32)


def group_moments(rewards: Array, group_ids: Array, valid: Array, *,
                  num_groups: int) -> tuple[Array, Array, Array]:
    """Per-group count, mean and unbiased std (Bessel, n-1) over valid sequences.

    Returns `(count, mean, std)`, each `[num_groups]`. Empty groups have mean 0; groups of one
    have std 0 (callers choose what a singleton means).
    """
    check_group_inputs("group_moments", rewards=rewards, group_ids=group_ids, valid=valid,
                       num_groups=num_groups)
    valid = jnp.asarray(valid).astype(bool)
    r = jnp.where(valid, as_float(rewards), 0.0)
    ids = safe_group_ids(group_ids, valid)
    w = valid.astype(r.dtype)
    count = jax.ops.segment_sum(w, ids, num_segments=num_groups)
    mean = jax.ops.segment_sum(r, ids, num_segments=num_groups) / jnp.maximum(count, 1.0)
    # Two-pass variance: exact zero for constant groups, no cancellation for large rewards.
    centred = jnp.where(valid, r - mean[ids], 0.0)
    sq = jax.ops.segment_sum(centred * centred, ids, num_segments=num_groups)
    std = jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0))
    return count, mean, std


def dynamic_sampling_filter(rewards: Array, group_ids: Array, valid: Array, *, num_groups: int,
                            tol: float = 0.0) -> tuple[tuple[Array, Array], dict[str, Array]]:
    """DAPO dynamic sampling: keep only groups whose rewards are not all equal.

        keep_group_g = [n_g > 0] * [max_{i in g} R_i - min_{i in g} R_i > tol]
        keep_i       = valid_i * keep_group_{g(i)}

    A group whose responses are all right (or all wrong) has zero group-relative advantage, so
    it adds no policy gradient but still dilutes token-mean losses (DAPO, arXiv 2503.14476,
    section 3.2).
    A group with a single valid member counts as constant and is dropped. DAPO filters on the
    accuracy metric (verl `filter_groups.metric: acc`), so pass the raw task reward or accuracy,
    not the length-shaped reward.

    Args:
      rewards: float [B], the metric to test for spread.
      group_ids: int [B], group of each sequence, in [0, num_groups).
      valid: bool [B], False for padding sequences.
      num_groups: static number of group slots.
      tol: a spread at or below `tol` counts as constant.

    Returns:
      `((keep [B] bool, keep_group [num_groups] bool), metrics)`; metrics: `kept_seq_frac` (over
      valid sequences), `kept_group_frac` (over non-empty groups), `num_groups_present`.
    """
    check_group_inputs("dynamic_sampling_filter", rewards=rewards, group_ids=group_ids,
                       valid=valid, num_groups=num_groups)
    valid = jnp.asarray(valid).astype(bool)
    rewards = as_float(rewards)
    ids = safe_group_ids(group_ids, valid)
    count = jax.ops.segment_sum(valid.astype(jnp.int32), ids, num_segments=num_groups)
    gmax = jax.ops.segment_max(jnp.where(valid, rewards, -jnp.inf), ids, num_segments=num_groups)
    gmin = jax.ops.segment_min(jnp.where(valid, rewards, jnp.inf), ids, num_segments=num_groups)
    present = count > 0
    spread = jnp.where(present, gmax - gmin, 0.0)
    keep_group = present & (spread > tol)
    keep = valid & keep_group[ids]
    n_present = present.sum()
    metrics = {
        "kept_seq_frac": keep.sum() / jnp.maximum(valid.sum(), 1),
        "kept_group_frac": keep_group.sum() / jnp.maximum(n_present, 1),
        "num_groups_present": n_present,
    }
    return (keep, keep_group), metrics


def overlong_penalty(lengths: Array, valid: Array | None = None, *, max_len: int, buffer: int,
                     penalty_factor: float = 1.0) -> tuple[Array, dict[str, Array]]:
    """DAPO soft overlong punishment, added to the task reward.

        R_len(L) = -penalty_factor * clip((L - (max_len - buffer)) / buffer, 0, 1)

    i.e. 0 up to `max_len - buffer` tokens, a linear ramp down to `-penalty_factor` at `max_len`,
    and a floor of `-penalty_factor` beyond `max_len` (DAPO, arXiv 2503.14476, section 3.4, whose
    third case is -1; `penalty_factor` scales the whole function). With `buffer == 0` it is a
    step: 0 for L <= max_len, -penalty_factor above.

    Difference from verl (`reward_manager/dapo.py`): verl computes
    `min(-(L - (max_len - buffer)) / buffer * penalty_factor, 0)` with no floor, so a response
    longer than `max_len` keeps getting a larger penalty. The two agree whenever generation is
    capped at `max_len`.

    Args:
      lengths: int or float [B], response lengths in tokens (all generated tokens).
      valid: optional bool [B]; only used for the metrics (penalties of invalid rows are 0).
      max_len: the hard limit L_max (> 0).
      buffer: the soft buffer L_cache, in [0, max_len].
      penalty_factor: scale of the penalty (>= 0).

    Returns:
      `(penalty [B] float, metrics)`; metrics: `overlong_frac` (valid sequences with a nonzero
      penalty), `overlong_penalty_mean` (over valid sequences).
    """
    if not isinstance(max_len, (int, np.integer)) or max_len <= 0:
        raise ValueError(f"overlong_penalty: max_len must be a positive int, got {max_len!r}")
    if not isinstance(buffer, (int, np.integer)) or not 0 <= buffer <= max_len:
        raise ValueError(f"overlong_penalty: buffer must be an int in [0, max_len={max_len}], "
                         f"got {buffer!r}")
    if not penalty_factor >= 0:
        raise ValueError(f"overlong_penalty: penalty_factor must be >= 0, got {penalty_factor!r}")
    chex.assert_rank(lengths, 1, custom_message="overlong_penalty: lengths must be [B]",
                     exception_type=ValueError)
    lengths = as_float(lengths)
    valid = jnp.ones(lengths.shape, bool) if valid is None else jnp.asarray(valid).astype(bool)
    chex.assert_equal_shape([lengths, valid],
                            custom_message="overlong_penalty: lengths and valid must both be [B]",
                            exception_type=ValueError)
    if buffer == 0:
        frac = (lengths > max_len).astype(lengths.dtype)
    else:
        frac = jnp.clip((lengths - (max_len - buffer)) / buffer, 0.0, 1.0)
    penalty = jnp.where(valid, -penalty_factor * frac, 0.0)
    n_valid = jnp.maximum(valid.sum(), 1)
    metrics = {
        "overlong_frac": (valid & (penalty < 0)).sum() / n_valid,
        "overlong_penalty_mean": penalty.sum() / n_valid,
    }
    return penalty, metrics
