"""Token sampling for the JAX engine: temperature, top-k, top-p, per-request keys, two log-probs.

For logits z [S, V] and per-row temperature T, top_k, top_p:

    z'      = z / T, with tokens outside the k largest set to -inf      (top_k = 0: all kept)
    p       = softmax(z')
    keep    = tokens whose ascending-order cumulative probability is > 1 - top_p, plus the
              most likely token (vLLM's `apply_top_k_top_p` rule: top-k first, then top-p on the
              renormalised top-k distribution)
    q       = softmax(z' restricted to keep)
    y       ~ q                      (greedy rows, T = 0: y = argmax z)
    logp    = log q(y)               (greedy: raw_logp)
    raw_logp = log softmax(z)[y]

With `logprobs` (the full log-softmax [S, V] of the zero-mismatch mode, computed by the
learner's batch-invariant code): raw_logp is read from it, and rows with T = 1 and no truncation
draw y from it, so y is sampled from exactly the distribution the learner scores.

Keys: row s draws with `fold_in(key(seed_s), counter_s)`, counter = index of the token in the
response. A request's draws therefore depend on its seed and position only, not on what else is
in the batch, and a resumed trajectory continues the stream where it stopped.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def _truncate(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set logits outside the top-k, then top-p set to -inf (row-wise; scaled [S, V])."""
    v = scaled.shape[-1]
    order = jnp.argsort(scaled, axis=-1)                          # ascending
    sorted_z = jnp.take_along_axis(scaled, order, axis=-1)
    rank_from_top = v - 1 - jnp.arange(v)                          # 0 for the largest
    k = jnp.where(top_k > 0, top_k, v)[:, None]
    sorted_z = jnp.where(rank_from_top[None, :] < k, sorted_z, NEG_INF)
    cum = jnp.cumsum(jax.nn.softmax(sorted_z, axis=-1), axis=-1)
    drop = (cum <= (1.0 - top_p)[:, None]) & (rank_from_top[None, :] > 0)
    sorted_z = jnp.where(drop, NEG_INF, sorted_z)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(sorted_z, inverse, axis=-1)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seeds: jax.Array, counters: jax.Array,
           logprobs: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens int32 [S], logp fp32 [S], raw_logp fp32 [S]) from fp32 logits [S, V] (module doc).

    temperature, top_p fp32 [S]; top_k int32 [S]; seeds uint32 [S]; counters int32 [S].
    """
    chex.assert_rank(logits, 2)
    chex.assert_shape([temperature, top_k, top_p, seeds, counters], (logits.shape[0],))
    logits = logits.astype(jnp.float32)
    raw = jax.nn.log_softmax(logits, axis=-1) if logprobs is None else logprobs
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    needs_truncation = jnp.any(((top_k > 0) | (top_p < 1.0)) & ~greedy)
    # Sorting the vocabulary is the expensive part; skip it when no row truncates.
    scaled = jax.lax.cond(needs_truncation, _truncate, lambda z, *_: z, scaled, top_k, top_p)
    processed = jax.nn.log_softmax(scaled, axis=-1)
    if logprobs is not None:
        exact_rows = (temperature == 1.0) & (top_k == 0) & (top_p >= 1.0)
        processed = jnp.where(exact_rows[:, None], logprobs, processed)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    drawn = jax.vmap(jax.random.categorical)(keys, processed)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    raw_logp = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    logp = jnp.where(greedy, raw_logp, jnp.take_along_axis(processed, tokens[:, None], axis=-1)[:, 0])
    return tokens, logp, raw_logp
