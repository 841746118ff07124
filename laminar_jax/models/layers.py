"""Pure-function building blocks of the decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

All numerics follow the transformers reference (`modeling_llama.py`, `modeling_qwen2.py`,
`modeling_qwen3.py`) so that the same weights give the same logits:
- RMSNorm computes in fp32 and casts back before the weight multiply;
- RoPE uses the "rotate half" layout, inv_freq_i = theta^(-2i/d), optionally rescaled by Llama-3's
  piecewise rule (Llama 3.1 report; transformers `_compute_llama3_parameters`);
- attention scale is head_dim^-1/2 and query head h reads kv head h // (num_heads/num_kv_heads).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from laminar_jax.models.config import DecoderConfig

# A finite "minus infinity": a fully masked row (padding) softmaxes to a uniform row, never NaN.
MASK_VALUE = float(np.finfo(np.float32).min)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """y = scale * x / sqrt(mean(x^2) + eps), reduced in fp32, returned in x.dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(cfg: DecoderConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in fp32, with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))))
    inv_freq = inv_freq.astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the middle band blended.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(cfg: DecoderConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of angle = position * inv_freq, each [..., head_dim // 2] fp32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, D] by position; cos/sin are [B, T, D/2]."""
    half = x.shape[-1] // 2
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _in_proj(p: dict, name: str, x: jax.Array, heads: int) -> jax.Array:
    """x [B, T, E] -> [B, T, heads, D] through `{name}_kernel` [E, heads, D] (the decoder's layout),
    or through `{name}_proj` [heads*D, E], the Hugging Face layout the relays serve: the JAX engine
    computes on the served weights as they are, so a version switch copies without transposing
    (`rollout.jax_served`)."""
    if name + "_kernel" in p:
        return jnp.einsum("bte,ehd->bthd", x, p[name + "_kernel"].astype(x.dtype))
    y = jnp.einsum("bte,fe->btf", x, p[name + "_proj"].astype(x.dtype))
    return y.reshape(*y.shape[:-1], heads, -1)


def qkv_projection(cfg: DecoderConfig, p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """Project x [B, T, E] to RoPE'd q [B, T, H, D] and k, v [B, T, K, D] in the compute dtype."""
    dt = x.dtype
    q = _in_proj(p, "q", x, cfg.num_heads)
    k = _in_proj(p, "k", x, cfg.num_kv_heads)
    v = _in_proj(p, "v", x, cfg.num_kv_heads)
    if cfg.qkv_bias:
        q = q + p["q_bias"].astype(dt)
        k = k + p["k_bias"].astype(dt)
        v = v + p["v_bias"].astype(dt)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(D) + mask) v with grouped-query heads, from an explicit mask.

    The decoder no longer calls this: `models.attention.attention` is the entry point and builds
    no [B, T, S] mask. Kept for callers that hold a mask.

    q [B, T, H, D]; k, v [B, S, K, D]; mask bool [B, T, S] (True = may attend). Scores and softmax
    in fp32; returns [B, T, H, D] in q.dtype.
    """
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(d))
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d)


def attention_output(p: dict, attn: jax.Array) -> jax.Array:
    if "o_kernel" not in p:  # served layout [E, H*D] (see `_in_proj`)
        flat = attn.reshape(*attn.shape[:-2], -1)
        return jnp.einsum("btf,ef->bte", flat, p["o_proj"].astype(attn.dtype))
    return jnp.einsum("bthd,hde->bte", attn, p["o_kernel"].astype(attn.dtype))


def swiglu_mlp(p: dict, x: jax.Array, *, chunk: int = 0) -> jax.Array:
    """down(silu(gate(x)) * up(x)).

    ``chunk > 0`` (``learner.mlp_chunk``): the sequence in chunks of ``chunk`` tokens (``lax.map``),
    each rematerialised in the backward pass, so the ``[B, chunk, mlp]`` intermediates of one
    chunk are alive at a time instead of ``[B, T, mlp]`` ("tiled MLP", Arctic long-sequence
    training, arXiv 2506.13996). Token-wise maths, so the values are the same; the weight
    gradients are summed over chunks in the weights' dtype (as the log-prob head's chunks are).
    Ragged T is zero-padded: a zero row maps to zero and adds nothing to any gradient.
    """
    dt = x.dtype
    served = "gate_kernel" not in p  # served layout: gate/up [M, E], down [E, M] (see `_in_proj`)
    w = tuple(p[k] for k in (("gate_proj", "up_proj", "down_proj") if served
                             else ("gate_kernel", "up_kernel", "down_kernel")))
    into, out = ("bte,me->btm", "btm,em->bte") if served else ("bte,em->btm", "btm,me->bte")

    def mlp(w, h):
        gate = jnp.einsum(into, h, w[0].astype(dt))
        up = jnp.einsum(into, h, w[1].astype(dt))
        return jnp.einsum(out, jax.nn.silu(gate) * up, w[2].astype(dt))

    b, t, e = x.shape
    if chunk <= 0 or chunk >= t:
        return mlp(w, x)
    n = -(-t // chunk)
    xp = jnp.pad(x, ((0, 0), (0, n * chunk - t), (0, 0))) if n * chunk != t else x
    xs = jnp.moveaxis(xp.reshape(b, n, chunk, e), 1, 0)            # [n, B, chunk, E]
    one = jax.checkpoint(lambda h: mlp(w, h))
    ys = jax.lax.map(one, xs)
    return jnp.moveaxis(ys, 0, 1).reshape(b, n * chunk, e)[:, :t]


def packed_causal_mask(segment_ids: jax.Array | None, batch: int, length: int) -> jax.Array:
    """bool [B, T, T]: key index <= query index, same segment, segment != 0 (0 = padding)."""
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))[None]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (batch, length, length))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids != 0)[:, :, None]
    return causal & same & real
