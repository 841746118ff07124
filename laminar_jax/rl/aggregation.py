"""Loss aggregation (`loss_agg_mode`) with an explicit, global normaliser.

Every mode is `sum(contributions) / normaliser`, where the contributions of a token depend only
on its own sequence. So if each micro-batch (and device) is given the normaliser of the whole
optimiser step, the sum of their losses is exactly the loss of the one big batch, and so are the
gradients (the trap of corrections.md section 2: normalising each micro-batch then averaging is a
different loss). `local_normaliser(...)` gives a micro-batch's share; sum (or `psum`) the shares.

With `m_{i,t}` the loss mask, `n_{i,t}` the denominator mask (= m, or the mask before rejection
when rejected tokens stay in the denominator) and B' the number of sequences with a token in n:

| mode                      | loss                                         | normaliser  | source |
|---------------------------|----------------------------------------------|-------------|--------|
| token-mean                | sum m L / sum n                               | sum n       | DAPO arXiv 2503.14476 |
| seq-mean-token-sum        | sum m L / B'                                 | B'          | verl |
| seq-mean-token-mean       | sum_i (sum_t m L / sum_t n) / B'             | B'          | GRPO arXiv 2402.03300 |
| seq-mean-token-sum-norm   | sum m L / (B' C)                             | B' C        | Dr.GRPO arXiv 2503.20783 |
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from laminar_jax.rl.seq_ops import masked, seq_gather, seq_sum, seq_view
from laminar_jax.rl.spec import AGGREGATIONS


def _check_mode(mode: str, norm_constant: float) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"rl.aggregation: mode={mode!r}; expected one of {AGGREGATIONS}")
    if mode == "seq-mean-token-sum-norm" and not norm_constant > 0:
        raise ValueError(f"rl.aggregation: norm_constant={norm_constant!r}; expected > 0 with "
                         f"mode 'seq-mean-token-sum-norm' (Dr.GRPO's constant C)")


def local_normaliser(mask: chex.Array, *, mode: str = "token-mean", norm_constant: float = 0.0,
               segment_ids: chex.Array | None = None,
               max_segments: int | None = None) -> jax.Array:
    """This batch's share of the loss normaliser (sum it over micro-batches and devices).

    token-mean: number of valid tokens; seq-mean-*: number of sequences with a valid token (B');
    Dr.GRPO: B' * C.
    """
    chex.assert_rank(mask, 2, custom_message="rl.aggregation.normaliser: mask")
    _check_mode(mode, norm_constant)
    m = (jnp.asarray(mask) > 0).astype(jnp.float32)
    if segment_ids is not None:
        m = m * (jnp.asarray(segment_ids) > 0)
    if mode == "token-mean":
        return jnp.sum(m)
    view = seq_view(m, segment_ids, max_segments)
    n_seq = jnp.sum(seq_sum(m, view) > 0).astype(jnp.float32)
    if mode == "seq-mean-token-sum-norm":
        return n_seq * jnp.float32(norm_constant)
    return n_seq


def aggregate(token_loss: chex.Array, mask: chex.Array, *, mode: str = "token-mean",
              normaliser: chex.Numeric | None = None, denominator_mask: chex.Array | None = None,
              norm_constant: float = 0.0, segment_ids: chex.Array | None = None,
              max_segments: int | None = None) -> jax.Array:
    """Scalar loss from per-token losses `[B, T]` (formulas in the module docstring).

    Args:
      token_loss: per-token loss L; values at masked positions are ignored (never multiplied).
      mask: loss mask m (after any rejection).
      mode: one of `spec.AGGREGATIONS`.
      normaliser: the step's global normaliser (sum of `local_normaliser(...)` shares of the
        denominator mask); None computes it from this batch alone.
      denominator_mask: n, the mask that counts tokens and sequences (default `mask`). Pass the
        mask before rejection to keep rejected tokens in the denominator (AReaL, slime).
      norm_constant: Dr.GRPO's C (only for 'seq-mean-token-sum-norm').
    """
    chex.assert_rank([token_loss, mask], 2)
    chex.assert_equal_shape([token_loss, mask], custom_message="rl.aggregation: token_loss/mask")
    _check_mode(mode, norm_constant)
    m = (jnp.asarray(mask) > 0).astype(jnp.float32)
    n = m if denominator_mask is None else (jnp.asarray(denominator_mask) > 0).astype(jnp.float32)
    if segment_ids is not None:
        m = m * (jnp.asarray(segment_ids) > 0)
        n = n * (jnp.asarray(segment_ids) > 0)
    n = jnp.maximum(n, m)  # a token in the loss always counts in the denominator
    contrib = masked(token_loss, m)
    if mode == "seq-mean-token-mean":
        view = seq_view(m, segment_ids, max_segments)
        length = seq_gather(seq_sum(n, view), view)
        contrib = contrib / jnp.maximum(length, 1.0)
    if normaliser is None:
        normaliser = local_normaliser(n, mode=mode, norm_constant=norm_constant,
                                      segment_ids=segment_ids, max_segments=max_segments)
    return jnp.sum(contrib) / jnp.maximum(jnp.asarray(normaliser, jnp.float32), 1e-8)
