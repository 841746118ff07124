"""The one attention entry point, `attention(q, k, v, ...)`, with implementations chosen by name.

Visibility rule shared by every implementation (no `[B, T, S]` mask is ever built outside the
naive reference): query t of row b may read key s iff

    kv_pos[b, s] <= q_pos[b, t]  and  q_seg[b, t] == kv_seg[b, s]  and  q_seg[b, t] != 0

so causal packed rows (segment ids, 0 = padding) and the KV-cache path (q_pos = cache position of
the new token, kv_pos = 0..max_len-1) are one rule. A query that may read nothing outputs 0.
Scores are scaled by head_dim^-1/2, computed and softmaxed in fp32; GQA: query head h reads kv
head h // (H / K).

Implementations (`model.attention`):
- "blockwise": flash-style online softmax over key blocks (Dao et al. 2022, "FlashAttention",
  Alg. 1), query blocks outside, in plain XLA; a `jax.custom_vjp` whose backward recomputes each
  block's probabilities from the saved log-sum-exp (Alg. 2), so neither pass stores scores bigger
  than one `[B, K, G, bq, bk]` block. Blocks entirely in the causal future are skipped.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` on GPU for rows that hold one
  right-padded sequence (sequence lengths, causal); packed rows (several segments) take the
  blockwise path inside a `lax.cond`, since that API has no segment ids. The KV-cache path uses
  cuDNN for decode (T = 1) and blockwise for prefill.
- "splash": the Pallas splash-attention kernel JAX ships for TPU (causal mask + segment ids), for
  the training path; the KV-cache path uses blockwise.
- "naive": materialised scores, the tests' reference.
- "exact": batch-invariant attention (`models.exact`: no dot, fixed-order sums), with the
  decoder's token-wise work in fixed-shape blocks too; what `rollout.zero_mismatch` uses on
  every backend, so engine and learner give bit-identical log-probs.
- "auto": cudnn on GPU, splash on TPU, blockwise elsewhere.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from laminar_jax.models import exact

IMPLEMENTATIONS = ("auto", "blockwise", "cudnn", "splash", "naive", "exact")
_BY_BACKEND = {"cpu": ("blockwise", "naive", "exact"), "gpu": ("cudnn", "blockwise", "naive", "exact"),
               "tpu": ("splash", "blockwise", "naive", "exact")}
_AUTO = {"gpu": "cudnn", "tpu": "splash"}
BLOCK_Q = 512
BLOCK_K = 512


def supported(backend: str | None = None) -> tuple[str, ...]:
    """Implementations available on `backend` (default: jax.default_backend())."""
    backend = backend or jax.default_backend()
    return ("auto",) + _BY_BACKEND.get(backend, ("blockwise", "naive", "exact"))


def resolve(name: str, backend: str | None = None) -> str:
    """The concrete implementation for `name` on `backend`; ValueError naming `model.attention`."""
    backend = backend or jax.default_backend()
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention: got {name!r}, expected one of {IMPLEMENTATIONS}")
    if name == "auto":
        return _AUTO.get(backend, "blockwise")
    if name not in supported(backend):
        raise ValueError(f"model.attention: {name!r} is not available on the {backend!r} backend, "
                         f"which supports {supported(backend)}")
    return name


def _visible(q_seg, kv_seg, q_pos, kv_pos):
    """bool [B, tq, tk] visibility (module docstring) of one block."""
    return ((kv_pos[:, None, :] <= q_pos[:, :, None]) & (q_seg[:, :, None] == kv_seg[:, None, :])
            & (q_seg != 0)[:, :, None])


# ---------------------------------------------------------------------------- naive reference
def naive(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    """Materialised-scores reference: q [B, T, H, D]; k, v [B, S, K, D]; int [B, T] / [B, S]."""
    b, t, h, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, h // kh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    mask = _visible(q_seg, kv_seg, q_pos, kv_pos)[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    mx = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(mx), mx, 0.0)), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v)
    return out.reshape(b, t, h, d)


# ---------------------------------------------------------------------------- blockwise (flash)
def _pad_to(x, axis, size, value):
    extra = size - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x, n, axis=1):
    """[B, n*bs, ...] -> [n, B, bs, ...]."""
    shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x, axis=1):
    """[n, B, bs, ...] -> [B, n*bs, ...]."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _skip(q_pos_blk, kv_pos_blk):
    """True when every key of the block is in the causal future of every query of the block."""
    return jnp.min(kv_pos_blk) > jnp.max(q_pos_blk)


def _fwd_impl(q, k, v, q_seg, kv_seg, q_pos, kv_pos, bq, bk):
    """Blocked forward: out [B, T, K, G, D] (q.dtype) and lse [B, K, G, T] fp32 (0 where empty)."""
    # Inside a layer scan, segment ids and positions are loop-invariant, and XLA would hoist the
    # per-block masks out of the layer loop, materialising all [nq, nk] of them (quadratic); the
    # barrier ties them to this layer's q.
    q, q_seg, kv_seg, q_pos, kv_pos = jax.lax.optimization_barrier((q, q_seg, kv_seg, q_pos, kv_pos))
    b, t, kh, g, d = q.shape
    scale = 1.0 / math.sqrt(d)
    nq, nk = t // bq, k.shape[1] // bk
    ks, vs, kseg_b, kpos_b = _blocks(k, nk), _blocks(v, nk), _blocks(kv_seg, nk), _blocks(kv_pos, nk)

    def q_block(args):
        qi, qseg_i, qpos_i = args

        def k_step(carry, kv):
            kj, vj, kseg_j, kpos_j = kv

            def compute(carry):
                m, l, acc = carry
                s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
                mask = _visible(qseg_i, kseg_j, qpos_i, kpos_j)[:, None, None]
                m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
                alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, 0.0) - m_safe)
                alpha = jnp.where(jnp.isfinite(m), alpha, 0.0)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vj.dtype), vj,
                                preferred_element_type=jnp.float32)
                return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

            return jax.lax.cond(_skip(qpos_i, kpos_j), lambda c: c, compute, carry), None

        init = (jnp.full((b, kh, g, bq), -jnp.inf, jnp.float32), jnp.zeros((b, kh, g, bq), jnp.float32),
                jnp.zeros((b, kh, g, bq, d), jnp.float32))
        (m, l, acc), _ = jax.lax.scan(k_step, init, (ks, vs, kseg_b, kpos_b))
        nonempty = l > 0
        out = acc / jnp.where(nonempty, l, 1.0)[..., None]
        lse = jnp.where(nonempty, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(nonempty, l, 1.0)), 0.0)
        return jnp.einsum("bkgqd->bqkgd", out).astype(q.dtype), lse

    out, lse = jax.lax.map(q_block, (_blocks(q, nq), _blocks(q_seg, nq), _blocks(q_pos, nq)))
    return _unblocks(out), jnp.moveaxis(lse, 0, 3).reshape(b, kh, g, t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, q_seg, kv_seg, q_pos, kv_pos, bq, bk):
    return _fwd_impl(q, k, v, q_seg, kv_seg, q_pos, kv_pos, bq, bk)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos, bq, bk):
    out, lse = _fwd_impl(q, k, v, q_seg, kv_seg, q_pos, kv_pos, bq, bk)
    return out, (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse)


def _flash_bwd(bq, bk, res, d_out):
    q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse = res
    d_out, q_seg, kv_seg, q_pos, kv_pos = jax.lax.optimization_barrier((d_out, q_seg, kv_seg, q_pos, kv_pos))
    b, t, kh, g, d = q.shape
    scale = 1.0 / math.sqrt(d)
    nq, nk = t // bq, k.shape[1] // bk
    # D_i = rowsum(dO_i * O_i) (FlashAttention Alg. 2, line 19)
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    q_b, do_b, qseg_b, qpos_b = _blocks(q, nq), _blocks(d_out, nq), _blocks(q_seg, nq), _blocks(q_pos, nq)
    lse_b, delta_b = _blocks(lse, nq, axis=3), _blocks(delta, nq, axis=3)

    def k_block(dq, kv):
        kj, vj, kseg_j, kpos_j = kv

        def q_step(acc, qs):
            qi, doi, qseg_i, qpos_i, lse_i, delta_i = qs

            def compute(acc):
                dk, dv = acc
                s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
                mask = _visible(qseg_i, kseg_j, qpos_i, kpos_j)[:, None, None]
                p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
                dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(doi.dtype), doi,
                                     preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
                ds = (p * (dp - delta_i[..., None]) * scale).astype(qi.dtype)
                dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=jnp.float32)
                dqi = jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=jnp.float32)
                return (dk, dv), dqi

            skip = lambda acc: (acc, jnp.zeros(qi.shape, jnp.float32))  # noqa: E731
            return jax.lax.cond(_skip(qpos_i, kpos_j), skip, compute, acc)

        zeros = jnp.zeros(kj.shape, jnp.float32)
        (dk, dv), dq_parts = jax.lax.scan(q_step, (zeros, zeros),
                                          (q_b, do_b, qseg_b, qpos_b, lse_b, delta_b))
        return dq + _unblocks(dq_parts), (dk, dv)

    dq, (dk, dv) = jax.lax.scan(k_block, jnp.zeros(q.shape, jnp.float32),
                                (_blocks(k, nk), _blocks(v, nk), _blocks(kv_seg, nk), _blocks(kv_pos, nk)))
    return (dq.astype(q.dtype), _unblocks(dk).astype(k.dtype), _unblocks(dv).astype(v.dtype),
            None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
    """Flash-style attention (module docstring); arguments as `naive`."""
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    bq, bk = min(block_q, t), min(block_k, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    # padded queries are segment 0 (read nothing); padded keys are segment -1 (read by nobody)
    qg = _pad_to(q.reshape(b, t, kh, h // kh, d), 1, tp, 0)
    out = _flash(qg, _pad_to(k, 1, sp, 0), _pad_to(v, 1, sp, 0),
                 _pad_to(q_seg.astype(jnp.int32), 1, tp, 0), _pad_to(kv_seg.astype(jnp.int32), 1, sp, -1),
                 _pad_to(q_pos.astype(jnp.int32), 1, tp, 0),
                 _pad_to(kv_pos.astype(jnp.int32), 1, sp, jnp.iinfo(jnp.int32).max), bq, bk)
    return out[:, :t].reshape(b, t, h, d)


# ---------------------------------------------------------------------------- accelerator kernels
def _single_prefix(seg):
    """True when every row's segment ids are 1...1 0...0 (one right-padded sequence)."""
    ones = seg == 1
    return jnp.all(ones | (seg == 0)) & jnp.all(ones[:, 1:] <= ones[:, :-1])


def _cudnn_train(q, k, v, seg, pos):
    lengths = jnp.sum(seg != 0, axis=1).astype(jnp.int32)

    def fast(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                           key_value_seq_lengths=lengths, implementation="cudnn")
        return jnp.where((seg != 0)[:, :, None, None], out, 0).astype(q.dtype)

    def general(q, k, v):
        return blockwise(q, k, v, seg, seg, pos, pos)
    return jax.lax.cond(_single_prefix(seg), fast, general, q, k, v)


def _splash_train(q, k, v, seg):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    b, t, h, d = q.shape
    kh = k.shape[2]
    mask = sa.MultiHeadMask([sa.CausalMask((t, t)) for _ in range(h // kh)])
    kernel = sa.make_splash_mqa_single_device(mask)
    qg = jnp.einsum("btkgd->bkgtd", q.reshape(b, t, kh, h // kh, d)) / math.sqrt(d)
    ids = sa.SegmentIds(q=seg.astype(jnp.int32), kv=seg.astype(jnp.int32))
    out = jax.vmap(jax.vmap(kernel, in_axes=(0, 0, 0, None)), in_axes=(0, 0, 0, 0))(
        qg, jnp.moveaxis(k, 2, 1), jnp.moveaxis(v, 2, 1), ids)
    out = jnp.einsum("bkgtd->btkgd", out).reshape(b, t, h, d)
    return jnp.where((seg != 0)[:, :, None, None], out, 0).astype(q.dtype)


# ---------------------------------------------------------------------------- entry points
def attention(q, k, v, *, impl: str = "auto", segment_ids=None, q_positions=None, kv_positions=None):
    """Attention of q [B, T, H, D] over k, v [B, S, K, D] (module docstring's rule).

    Training path: `segment_ids` [B, T] (T == S; None = one sequence per row), causal by index.
    KV-cache path: `q_positions` [B, T] with `kv_positions` [B, S] (or None = 0..S-1), no
    segments. Returns [B, T, H, D] in q.dtype.
    """
    name = resolve(impl)
    b, t = q.shape[:2]
    s = k.shape[1]
    if q_positions is None:  # training path
        if s != t:
            raise ValueError(f"attention: training path needs S == T, got T={t}, S={s}")
        seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if name == "cudnn":
            return _cudnn_train(q, k, v, seg, pos)
        if name == "splash":
            return _splash_train(q, k, v, seg)
        fn = {"naive": naive, "exact": exact.attention}.get(name, blockwise)
        return fn(q, k, v, seg, seg, pos, pos)
    if segment_ids is not None:
        raise ValueError("attention: segment_ids are for the training path, not with q_positions")
    kv_pos = (jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)) if kv_positions is None
              else kv_positions.astype(jnp.int32))
    q_pos = q_positions.astype(jnp.int32)
    if name == "cudnn" and t == 1 and kv_positions is None:
        out = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=q_pos[:, 0] + 1,
                                           implementation="cudnn")
        return out.astype(q.dtype)
    ones_q, ones_k = jnp.ones((b, t), jnp.int32), jnp.ones((b, s), jnp.int32)
    fn = {"naive": naive, "exact": exact.attention}.get(name, blockwise)
    return fn(q, k, v, ones_q, ones_k, q_pos, kv_pos)
