"""Jitted prefill and decode over a paged KV cache, for `rollout.jax_engine`.

The cache is a pool of pages, `k_pages, v_pages: [layers, num_pages, page_size, kv_heads,
head_dim]`; each request owns a list of pages (its row of the host-side page table). A call works
on a window: the pages a row needs are gathered into a contiguous `[layers, S, W, ...]` sub-cache
(W = pages * page_size), the model's KV-cache path (`Decoder.hidden_cached`, slots 0..S-1) runs on
it, and only the newly written positions are scattered back into the pool. So the cost of a decode
scales with the rows and the window actually used, and shapes come from a few buckets: S (rows)
and W (pages) are powers of two, chosen by the host.

Both functions take the params as an argument (new weights never recompile) and donate the page
pools (updated in place).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from laminar_jax.models.decoder import KVCache
from rollout.jax_sampling import sample


def _window(pages: jax.Array, rows: jax.Array) -> jax.Array:
    """Gather pages [L, P, ps, K, D] by rows [S, Pw] into [L, S, Pw*ps, K, D]."""
    g = pages[:, rows]
    return g.reshape(g.shape[0], g.shape[1], g.shape[2] * g.shape[3], *g.shape[4:])


def _sample(model, hidden: jax.Array, *sampling):
    """Sample from the last hidden states [S, E]. With `model.attention: exact`
    (rollout.zero_mismatch) the LM head and log-softmax are the learner's batch-invariant ones
    (`Decoder.exact_logits`), and untempered rows draw from exactly those log-probs."""
    if model.cfg.attention == "exact":
        logits, lse = model.exact_logits(hidden)
        return sample(logits, *sampling, logprobs=logits - lse[:, None])
    kernel = model.lm_head_kernel().astype(hidden.dtype)
    logits = jnp.einsum("se,ev->sv", hidden, kernel, preferred_element_type=jnp.float32)
    return sample(logits, *sampling)


def decode(graphdef, params, k_pages, v_pages, tokens, positions, rows, valid,
           temperature, top_k, top_p, seeds, counters):
    """One token per row: feed `tokens[s]` at `positions[s]`, sample the next.

    tokens, positions int32 [S]; rows int32 [S, Pw] (page ids, window = Pw pages); valid bool [S].
    Returns (k_pages, v_pages, next_tokens, logp, raw_logp).
    """
    model = nnx.merge(graphdef, params)
    s = tokens.shape[0]
    page_size = k_pages.shape[2]
    sub = KVCache(_window(k_pages, rows), _window(v_pages, rows), jnp.zeros((s,), jnp.int32))
    slots = jnp.arange(s, dtype=jnp.int32)
    hidden, sub = model.hidden_cached(tokens[:, None], positions[:, None], sub, slots, valid[:, None])
    # Write back only the new position; padding rows get an out-of-range page (dropped).
    page = jnp.where(valid, rows[slots, positions // page_size], k_pages.shape[1])
    offset = positions % page_size
    k_pages = k_pages.at[:, page, offset].set(sub.k[:, slots, positions], mode="drop")
    v_pages = v_pages.at[:, page, offset].set(sub.v[:, slots, positions], mode="drop")
    return (k_pages, v_pages) + _sample(model, hidden[:, 0], temperature, top_k, top_p, seeds, counters)


def prefill(graphdef, params, k_pages, v_pages, tokens, lengths, rows, valid,
            temperature, top_k, top_p, seeds, counters):
    """Write `tokens[s, :lengths[s]]` at positions 0.. and sample the token after them.

    tokens int32 [S, T] (T = Pw * page_size, right-padded); lengths int32 [S] (>= 1);
    rows int32 [S, Pw]; valid bool [S] (False: padding row). Returns as `decode`.
    """
    model = nnx.merge(graphdef, params)
    s, t = tokens.shape
    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    layers, kv_heads, head_dim = k_pages.shape[0], k_pages.shape[3], k_pages.shape[4]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
    token_valid = (positions < lengths[:, None]) & valid[:, None]
    zeros = jnp.zeros((layers, s, t, kv_heads, head_dim), k_pages.dtype)
    sub = KVCache(zeros, zeros, jnp.zeros((s,), jnp.int32))
    slots = jnp.arange(s, dtype=jnp.int32)
    hidden, sub = model.hidden_cached(tokens, positions, sub, slots, token_valid)
    pw = rows.shape[1]
    used = (jnp.arange(pw)[None, :] * page_size < lengths[:, None]) & valid[:, None]
    target = jnp.where(used, rows, num_pages)
    shape = (layers, s, pw, page_size, kv_heads, head_dim)
    k_pages = k_pages.at[:, target].set(sub.k.reshape(shape), mode="drop")
    v_pages = v_pages.at[:, target].set(sub.v.reshape(shape), mode="drop")
    last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return (k_pages, v_pages) + _sample(model, last, temperature, top_k, top_p, seeds, counters)


def extend(graphdef, params, k_pages, v_pages, tokens, starts, lengths, rows, valid,
           temperature, top_k, top_p, seeds, counters):
    """Write `tokens[s, :lengths[s]]` at positions starts[s].. after K/V already in the pages
    (a continuation whose earlier context was kept: multi-turn), and sample the token after them.

    tokens int32 [S, T] (right-padded); starts, lengths int32 [S] (lengths >= 1); rows int32
    [S, Pw] covering starts + lengths positions; valid bool [S]. `decode` is the T = 1 case, and
    with starts = 0 this computes what `prefill` does. Returns as `decode`.
    """
    model = nnx.merge(graphdef, params)
    s, t = tokens.shape
    page_size = k_pages.shape[2]
    sub = KVCache(_window(k_pages, rows), _window(v_pages, rows), jnp.zeros((s,), jnp.int32))
    slots = jnp.arange(s, dtype=jnp.int32)
    offsets = jnp.arange(t, dtype=jnp.int32)
    positions = starts[:, None] + offsets[None, :]
    token_valid = (offsets[None, :] < lengths[:, None]) & valid[:, None]
    hidden, sub = model.hidden_cached(tokens, positions, sub, slots, token_valid)
    # Write back only the new positions; padding gets an out-of-range page (dropped).
    safe = jnp.where(token_valid, positions, 0)
    page = jnp.where(token_valid, jnp.take_along_axis(rows, safe // page_size, axis=1), k_pages.shape[1])
    k_new = sub.k[:, slots[:, None], safe]
    v_new = sub.v[:, slots[:, None], safe]
    k_pages = k_pages.at[:, page, safe % page_size].set(k_new, mode="drop")
    v_pages = v_pages.at[:, page, safe % page_size].set(v_new, mode="drop")
    last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return (k_pages, v_pages) + _sample(model, last, temperature, top_k, top_p, seeds, counters)


@functools.lru_cache(maxsize=8)
def make_step_fns(graphdef):
    """(decode_fn, prefill_fn, extend_fn): jitted, page pools donated, graphdef bound.

    Cached by graphdef, so engines on the same architecture share compiled shapes."""
    jit = functools.partial(jax.jit, donate_argnums=(1, 2))
    return (jit(functools.partial(decode, graphdef)), jit(functools.partial(prefill, graphdef)),
            jit(functools.partial(extend, graphdef)))
