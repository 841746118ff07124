"""Batch-invariant ("exact") numerics: the decoder's `model.attention: exact` mode, which
`rollout.zero_mismatch` turns on for the learner and the JAX engine alike.

Goal: the value computed for one token depends only on that token's inputs (and, in attention,
on the keys it may read), never on how many other tokens share the call, where it sits in the
batch, how much padding or KV window surrounds it, or whether it is a 1-token decode step or a
T-token training row. Then the engine's behaviour log-probs and the learner's recompute of the
same tokens with the same weights are bit-identical.

What XLA CPU needs (measured, experiments/mismatch_engine_vs_learner.py and the notes in
docs/corrections.md): a `dot` of [M, K] x [K, N] changes its reduction order with M (Eigen/XLA
pick kernels and K-blocking from the whole shape; fp32 results differ in the last bits for
M = 1 vs 2 vs 64), and a reduction over the minor axis can change when the other dims are 1. So:

- Token-wise work (RMSNorm, the q/k/v, output and MLP matmuls, the LM head and its
  log-sum-exp) runs through `rowwise`: the tokens are flattened, padded to a multiple of
  `ROW_BLOCK` and mapped (`lax.map`) block by block, so every matmul and reduction XLA compiles
  has the one fixed shape [ROW_BLOCK, ...] whatever the caller's batch. Row i of a block does
  not depend on the other rows (checked: any row position, any block content).
- Attention (`attention`) uses no `dot` at all: q.k is a fixed pairwise tree over head_dim of
  elementwise products, the softmax is two-pass (an exact max over every visible key, then
  sum_j exp(s_j - max) and sum_j exp(s_j - max) v_j accumulated key by key in key order).
  Masked keys add exactly +0.0, so the sums depend only on the visible keys and their order:
  the same for a decode query over a padded KV window as for the same token in a (packed,
  padded) training row. Key blocks of `KEY_BLOCK` only set how many keys one loop step adds
  (in order); blocks past every query are skipped, which is exactly a no-op.

Gradients: `rowwise` and `attention` are `jax.custom_vjp`s whose backward is the ordinary
(fast, not batch-invariant) computation's: `jax.vjp` of the plain function for token-wise work,
the flash-attention backward of `models.attention.blockwise` for attention. Only the forward
values need to be exact; the training gradient is the usual one.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

ROW_BLOCK = 16   # tokens per fixed-shape block of token-wise work
KEY_BLOCK = 16   # keys added (in order) per attention loop step


# ---------------------------------------------------------------------------- token-wise work
def _blocked(fn, params, xs, block):
    lead = xs[0].shape[:-1]
    m = math.prod(lead)
    n = -(-m // block)
    flat = [x.reshape((m,) + x.shape[len(lead):]) for x in xs]
    padded = [jnp.pad(x, ((0, n * block - m),) + ((0, 0),) * (x.ndim - 1)).reshape((n, block) + x.shape[1:])
              for x in flat]
    # The barrier pins each block's operands as materialised arrays: without it XLA may fold a
    # producer (e.g. the tied LM head's transpose) into the dot when the map has one iteration
    # and not when it has several, and the two dots round differently.
    out = jax.lax.map(lambda blk: fn(*jax.lax.optimization_barrier((params,) + blk)), tuple(padded))
    return jax.tree.map(lambda y: y.reshape((n * block,) + y.shape[2:])[:m].reshape(lead + y.shape[2:]), out)


def rowwise(fn, *, block: int = ROW_BLOCK):
    """`g(params, *xs)`: `fn(params, *rows)` computed on fixed [block, ...] slices of the tokens.

    Every x in xs is [*lead, ...] with the same leading token dims `lead` (the last axis, or the
    trailing axes past `lead`, are per-token features; pass `xs[0]` with exactly one feature axis).
    `fn` must be token-wise (row i of its outputs depends on row i of its inputs only) and takes
    rows [block, ...]; its outputs come back as [*lead, ...]. Float inputs only.
    """
    @jax.custom_vjp
    def g(params, *xs):
        return _blocked(fn, params, xs, block)

    def fwd(params, *xs):
        return _blocked(fn, params, xs, block), (params, xs)

    def bwd(res, ct):
        params, xs = res
        lead = xs[0].ndim - 1
        flat = [x.reshape((-1,) + x.shape[lead:]) for x in xs]
        _, vjp = jax.vjp(fn, params, *flat)
        ct_flat = jax.tree.map(lambda c: c.reshape((-1,) + c.shape[lead:]), ct)
        grads = vjp(ct_flat)
        return (grads[0],) + tuple(gx.reshape(x.shape) for gx, x in zip(grads[1:], xs))

    g.defvjp(fwd, bwd)
    return g


# ---------------------------------------------------------------------------- attention
def tree_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a fixed pairwise tree of elementwise adds (zero-padded to a
    power of two; +0.0 is exact), so the order never depends on the other axes' sizes."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def _visible(q_seg, kv_seg, q_pos, kv_pos):
    """bool [B, T, bk] (the visibility rule of models.attention)."""
    return ((kv_pos[:, None, :] <= q_pos[:, :, None]) & (q_seg[:, :, None] == kv_seg[:, None, :])
            & (q_seg != 0)[:, :, None])


def _exact_fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos, block_k):
    b, t, h, d = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = h // kh
    nk = -(-s_len // block_k)
    pad = nk * block_k - s_len
    if pad:
        k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))
        kv_seg = jnp.pad(kv_seg, ((0, 0), (0, pad)), constant_values=-1)
        kv_pos = jnp.pad(kv_pos, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).max)
    scale = 1.0 / math.sqrt(d)
    qg = jnp.moveaxis(q.reshape(b, t, kh, g, d).astype(jnp.float32), 1, 3)        # [b, kh, g, t, d]
    blocks = lambda x: jnp.moveaxis(x.reshape((b, nk, block_k) + x.shape[2:]), 1, 0)  # noqa: E731
    kb, vb = blocks(k.astype(jnp.float32)), blocks(v.astype(jnp.float32))           # [nk, b, bk, kh, d]
    segb, posb = blocks(kv_seg), blocks(kv_pos)
    far = jnp.max(jnp.where(q_seg != 0, q_pos, -1))

    def scores(kj, segj, posj):
        kt = jnp.moveaxis(kj, 1, 2)[:, :, None, None]                              # [b, kh, 1, 1, bk, d]
        s = tree_sum(qg[:, :, :, :, None, :] * kt) * scale                          # [b, kh, g, t, bk]
        return s, _visible(q_seg, segj, q_pos, posj)[:, None, None]

    def max_step(mx, blk):
        kj, segj, posj = blk

        def compute(mx):
            s, mask = scores(kj, segj, posj)
            return jnp.maximum(mx, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
        return jax.lax.cond(jnp.min(posj) > far, lambda m: m, compute, mx), None

    mx, _ = jax.lax.scan(max_step, jnp.full((b, kh, g, t), -jnp.inf, jnp.float32), (kb, segb, posb))
    m_safe = jnp.where(jnp.isfinite(mx), mx, 0.0)

    def sum_step(carry, blk):
        kj, vj, segj, posj = blk

        def compute(carry):
            l, acc = carry
            s, mask = scores(kj, segj, posj)
            p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)                # [b, kh, g, t, bk]
            vt = jnp.moveaxis(vj, 1, 2)[:, :, None, None]                          # [b, kh, 1, 1, bk, d]

            def one_key(c, pv):  # one key at a time, in key order
                pj, vjj = pv
                return (c[0] + pj, c[1] + pj[..., None] * vjj), None
            (l, acc), _ = jax.lax.scan(one_key, (l, acc), (jnp.moveaxis(p, -1, 0), jnp.moveaxis(vt, -2, 0)))
            return l, acc
        return jax.lax.cond(jnp.min(posj) > far, lambda c: c, compute, carry), None

    init = (jnp.zeros((b, kh, g, t), jnp.float32), jnp.zeros((b, kh, g, t, d), jnp.float32))
    (l, acc), _ = jax.lax.scan(sum_step, init, (kb, vb, segb, posb))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.moveaxis(out, 3, 1).reshape(b, t, h, d).astype(q.dtype)


def attention(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, block_k: int = KEY_BLOCK):
    """Batch-invariant attention (module docstring); arguments as `models.attention.naive`:
    q [B, T, H, D]; k, v [B, S, K, D]; int q_seg, q_pos [B, T], kv_seg, kv_pos [B, S]."""
    ints = tuple(x.astype(jnp.int32) for x in (q_seg, kv_seg, q_pos, kv_pos))

    # the integer masks are arguments, not closed over: inside the layer scan they are tracers
    @jax.custom_vjp
    def f(q, k, v, *ints):
        return _exact_fwd(q, k, v, *ints, block_k)

    def fwd(q, k, v, *ints):
        return f(q, k, v, *ints), (q, k, v, ints)

    def bwd(res, ct):
        from laminar_jax.models.attention import blockwise
        q, k, v, ints = res
        _, vjp = jax.vjp(lambda q, k, v: blockwise(q, k, v, *ints), q, k, v)
        return vjp(ct) + (None,) * len(ints)

    f.defvjp(fwd, bwd)
    return f(q, k, v, *ints)
