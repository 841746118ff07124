"""Masked, padding-safe array helpers shared by the loss library.

Conventions (corrections.md section 0): every log-ratio is formed in fp32, non-finite values are
replaced by 0 (as AReaL), masked positions are zeroed and the result is clamped to +-20 (verl's
SAFETY_BOUND) *before* any `exp`, so garbage log-probs at padding can give neither inf nor NaN, in
the forward pass or through the gradient of `where`.

Sequences: per-token arrays are `[B, T]`. Without `segment_ids` each row is one sequence. With
packed rows, `segment_ids[b, t] > 0` names the sequence inside row `b` (segments contiguous, 0 =
padding) and sequence reductions run per (row, segment).
"""
from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

LOG_RATIO_BOUND = 20.0


def as_mask(mask: chex.Array, segment_ids: chex.Array | None = None) -> jax.Array:
    """Float32 0/1 mask; tokens of padding segments (segment id 0) are masked too."""
    m = jnp.asarray(mask) > 0
    if segment_ids is not None:
        m = m & (jnp.asarray(segment_ids) > 0)
    return m.astype(jnp.float32)


def masked(x: chex.Array, mask: chex.Array) -> jax.Array:
    """`x` in fp32 with masked positions set to 0 (a `where`, never `x * mask`: 0 * inf = NaN)."""
    return jnp.where(mask > 0, jnp.asarray(x, jnp.float32), 0.0)


def log_ratio(logp_num: chex.Array, logp_den: chex.Array, mask: chex.Array) -> jax.Array:
    """log(p_num / p_den) per token: fp32, non-finite -> 0, 0 where masked, clamped to +-20."""
    d = jnp.asarray(logp_num, jnp.float32) - jnp.asarray(logp_den, jnp.float32)
    d = jnp.where((mask > 0) & jnp.isfinite(d), d, 0.0)
    return jnp.clip(d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def safe_exp(x: chex.Array) -> jax.Array:
    return jnp.exp(jnp.clip(x, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


class SeqView(NamedTuple):
    """Sequence index of every token; `num` is static, so shapes never depend on the data."""

    index: jax.Array  # [B, T] int32
    num: int


def seq_view(mask: chex.Array, segment_ids: chex.Array | None = None,
             max_segments: int | None = None) -> SeqView:
    """Map tokens to sequence slots: row b (unpacked) or (b, segment) (packed, segments <= max)."""
    b, t = jnp.shape(mask)
    if segment_ids is None:
        return SeqView(jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t)), b)
    k = t if max_segments is None else int(max_segments)
    seg = jnp.clip(jnp.asarray(segment_ids, jnp.int32), 0, k)
    return SeqView(jnp.arange(b, dtype=jnp.int32)[:, None] * (k + 1) + seg, b * (k + 1))


def seq_sum(x: chex.Array, view: SeqView) -> jax.Array:
    """Per-sequence sum `[num]` of a per-token array (mask it first)."""
    return jax.ops.segment_sum(jnp.ravel(x), jnp.ravel(view.index), num_segments=view.num)


def seq_gather(per_seq: chex.Array, view: SeqView) -> jax.Array:
    """Broadcast a per-sequence array `[num]` back to tokens `[B, T]`."""
    return jnp.asarray(per_seq)[view.index]


def seq_mean(x: chex.Array, mask: chex.Array, view: SeqView) -> tuple[jax.Array, jax.Array]:
    """Per-sequence masked mean `[num]` and token count `[num]` (mean 0 for empty sequences)."""
    n = seq_sum(mask, view)
    return seq_sum(masked(x, mask), view) / jnp.maximum(n, 1.0), n


def suffix_sum(x: chex.Array, view: SeqView) -> jax.Array:
    """Exclusive suffix sum inside each sequence: out[b, t] = sum of x[b, j] over j > t, same seq.

    A row-level reverse cumsum minus the part that lies after the token's own segment (the row
    suffix at the segment's last position), so packed rows need no loop.
    """
    x = jnp.asarray(x, jnp.float32)
    row_excl = jnp.flip(jnp.cumsum(jnp.flip(x, 1), 1), 1) - x
    nxt = jnp.concatenate([view.index[:, 1:], jnp.full_like(view.index[:, :1], -1)], axis=1)
    is_last = (view.index != nxt).astype(jnp.float32)
    after_seq = seq_gather(seq_sum(row_excl * is_last, view), view)
    return row_excl - after_seq


def last_valid(mask: chex.Array, view: SeqView) -> jax.Array:
    """1 at the last valid token of each sequence, else 0."""
    return mask * (suffix_sum(mask, view) == 0)


def masked_mean(x: chex.Array, mask: chex.Array) -> jax.Array:
    return jnp.sum(masked(x, mask)) / jnp.maximum(jnp.sum(mask), 1.0)


def masked_max(x: chex.Array, mask: chex.Array) -> jax.Array:
    """Max over valid entries; 0 when there is none."""
    v = jnp.max(jnp.where(mask > 0, jnp.asarray(x, jnp.float32), -jnp.inf))
    return jnp.where(jnp.any(mask > 0), v, 0.0)


def masked_min(x: chex.Array, mask: chex.Array) -> jax.Array:
    """Min over valid entries; 0 when there is none."""
    v = jnp.min(jnp.where(mask > 0, jnp.asarray(x, jnp.float32), jnp.inf))
    return jnp.where(jnp.any(mask > 0), v, 0.0)


def check_token_array(name: str, x: chex.Array, shape: tuple[int, ...], where: str) -> None:
    """Raise a ValueError naming the tensor when it is not `[B, T]` like the mask."""
    if x is None:
        raise ValueError(f"{where}: {name} is None; expected an array of shape {shape}")
    if tuple(jnp.shape(x)) != tuple(shape):
        raise ValueError(f"{where}: {name} has shape {tuple(jnp.shape(x))}; expected "
                         f"{tuple(shape)} (the shape of mask)")
