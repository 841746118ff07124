"""Staleness (version lag) corrections and statistics.

staleness k = v_learner - v_behaviour per token (`[B, T]`; with partial rollouts tokens of one
sequence can differ) or per sequence (`[B]`, broadcast by `staleness_per_token`).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from laminar_jax.rl.seq_ops import SeqView, seq_sum


def staleness_per_token(staleness: chex.Array | None, mask: chex.Array) -> jax.Array:
    """Float32 `[B, T]` staleness from `[B]`, `[B, T]` or None (None = all fresh, k = 0)."""
    b, t = jnp.shape(mask)
    if staleness is None:
        return jnp.zeros((b, t), jnp.float32)
    s = jnp.asarray(staleness, jnp.float32)
    if s.shape == (b,):
        s = jnp.broadcast_to(s[:, None], (b, t))
    if s.shape != (b, t):
        raise ValueError(f"rl.staleness: staleness has shape {s.shape}; expected ({b},) or "
                         f"({b}, {t}) (per sequence or per token, like mask)")
    return jnp.where(mask > 0, jnp.maximum(s, 0.0), 0.0)


def staleness_keep(staleness: chex.Array, mask: chex.Array, *, max_staleness: int) -> jax.Array:
    """Staleness cap: keep tokens with k <= max_staleness (AReaL `max_head_offpolicyness`,
    prime-rl `max_off_policy_steps`; here as a loss mask, for data a buffer did not drop)."""
    chex.assert_equal_shape([staleness, mask], custom_message="rl.staleness: staleness/mask")
    keep = staleness <= max_staleness
    return jax.lax.stop_gradient(jnp.where(mask > 0, keep.astype(jnp.float32), 1.0))


def staleness_decay_weights(staleness: chex.Array, mask: chex.Array, *, decay: float) -> jax.Array:
    """w = decay ** k. A new ablation with no published source (corrections.md section 6)."""
    chex.assert_equal_shape([staleness, mask], custom_message="rl.staleness: staleness/mask")
    w = jnp.power(jnp.float32(decay), staleness)
    return jax.lax.stop_gradient(jnp.where(mask > 0, w, 1.0))


def staleness_histogram(staleness: chex.Array, mask: chex.Array, view: SeqView, *,
                        bins: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sequence counts per staleness bin `[bins]` (last bin = k >= bins - 1), mean and max.

    A sequence's staleness is that of its oldest token (the "head" staleness).
    """
    seq_k = jax.ops.segment_max(jnp.ravel(jnp.where(mask > 0, staleness, 0.0)),
                                jnp.ravel(view.index), num_segments=view.num)
    valid = seq_sum(mask, view) > 0
    seq_k = jnp.where(valid, seq_k, 0.0)
    idx = jnp.clip(seq_k, 0, bins - 1).astype(jnp.int32)
    hist = jnp.zeros((bins,), jnp.float32).at[idx].add(valid.astype(jnp.float32))
    n = jnp.maximum(jnp.sum(valid), 1)
    return hist, jnp.sum(seq_k) / n, jnp.max(seq_k)
