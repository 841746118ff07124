"""Flax NNX decoder for the Llama / Qwen2 / Qwen3 family, with a KV-cache path for rollouts.

Parameters (the pure dict `nnx.state(model, nnx.Param).to_pure_dict()`); layers are stacked on a
leading `layers` axis and run with `jax.lax.scan` (one compiled layer, whatever the depth):

    embedding          [vocab, embed]                  ("vocab", "embed")
    layers/attn_norm   [L, embed]                      ("layers", "norm")
    layers/q_kernel    [L, embed, heads, head_dim]     ("layers", "embed", "heads", "head_dim")
    layers/k_kernel    [L, embed, kv_heads, head_dim]  ("layers", "embed", "kv_heads", "head_dim")
    layers/v_kernel    [L, embed, kv_heads, head_dim]  ("layers", "embed", "kv_heads", "head_dim")
    layers/o_kernel    [L, heads, head_dim, embed]     ("layers", "heads", "head_dim", "embed")
    layers/q_bias      [L, heads, head_dim]            (qkv_bias only)
    layers/k_bias      [L, kv_heads, head_dim]         (qkv_bias only; v_bias alike)
    layers/q_norm      [L, head_dim]                   (qk_norm only; k_norm alike, ("layers", "norm"))
    layers/mlp_norm    [L, embed]                      ("layers", "norm")
    layers/gate_kernel [L, embed, mlp]                 ("layers", "embed", "mlp"; up_kernel alike)
    layers/down_kernel [L, mlp, embed]                 ("layers", "mlp", "embed")
    final_norm         [embed]                         ("norm",)
    lm_head            [embed, vocab]                  (untied only; ("embed", "vocab"))

The logical names are stored in each Param's `out_sharding` metadata (flax 0.12 renamed
`sharding_names` to `out_sharding`; the old name still reads it, with a deprecation warning).
Params are created with `eager_sharding=False`, so a model builds without a mesh;
`nnx.get_partition_spec(state)` under `nnx.logical_axis_rules(...)` maps them onto one.

KV-cache path (rollout engine; pure and jit-friendly, no Python state):

    cache = init_cache(cfg, num_slots, max_len, dtype=None)      # KVCache, zeros
    logits, cache = model.forward_cached(tokens, positions, cache, slot_ids, valid)
    hidden, cache = model.hidden_cached(tokens, positions, cache, slot_ids, valid)

- `KVCache.k`, `.v`: [layers, num_slots, max_len, kv_heads, head_dim]; `.lengths`: int32
  [num_slots], one past the highest position written into the slot (KV use for the manager).
- `tokens, positions`: int32 [S, T]; `slot_ids`: int32 [S], distinct; `valid`: bool [S, T].
  The K/V of token (s, t) is written at cache[slot_ids[s], positions[s, t]] when valid[s, t]
  (invalid tokens write nothing; their outputs are finite garbage). Then query (s, t) attends to
  every entry of its slot at positions <= positions[s, t]. So prefill is T = prompt length with
  positions 0..n-1, decode is T = 1 at position n; both for any mix of slots in one call.
- A slot's positions 0..p-1 must have been written (earlier or in the same call) before a query
  at p reads them; stale entries beyond a new occupant's positions are never read, so freeing a
  slot is `cache.lengths.at[slot].set(0)` (`reset_slots`). Positions must be < max_len.
- Jit the step with the cache donated (`donate_argnums`): the cache is updated in place layer by
  layer. For sampling only the last prompt token's logits, call `hidden_cached`, gather the row
  and multiply by `lm_head_kernel()` rather than computing [S, T, vocab] logits.
- `from_params(cfg, params)` builds a Decoder around an existing params tree (no random init).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from laminar_jax.models import attention as A
from laminar_jax.models import exact as X
from laminar_jax.models.grad_accumulation import add_to_grad, scan_layers_into
from laminar_jax.models import layers as L
from laminar_jax.models.config import DecoderConfig

_INIT_STD = 0.02  # transformers `initializer_range` default


def _param(init, key, shape, dtype, names):
    return nnx.Param(init(key, shape, dtype), out_sharding=names, eager_sharding=False)


_normal = jax.nn.initializers.normal(_INIT_STD)
_ones = jax.nn.initializers.ones
_zeros = jax.nn.initializers.zeros


class DecoderLayers(nnx.Module):
    """All transformer blocks, stacked on a leading `layers` axis."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        n, e, h, k, d, m = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                            cfg.head_dim, cfg.intermediate_size)
        pd = jnp.dtype(cfg.param_dtype)
        self.attn_norm = _param(_ones, None, (n, e), pd, ("layers", "norm"))
        self.q_kernel = _param(_normal, rngs.params(), (n, e, h, d), pd, ("layers", "embed", "heads", "head_dim"))
        self.k_kernel = _param(_normal, rngs.params(), (n, e, k, d), pd, ("layers", "embed", "kv_heads", "head_dim"))
        self.v_kernel = _param(_normal, rngs.params(), (n, e, k, d), pd, ("layers", "embed", "kv_heads", "head_dim"))
        self.o_kernel = _param(_normal, rngs.params(), (n, h, d, e), pd, ("layers", "heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.q_bias = _param(_zeros, None, (n, h, d), pd, ("layers", "heads", "head_dim"))
            self.k_bias = _param(_zeros, None, (n, k, d), pd, ("layers", "kv_heads", "head_dim"))
            self.v_bias = _param(_zeros, None, (n, k, d), pd, ("layers", "kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = _param(_ones, None, (n, d), pd, ("layers", "norm"))
            self.k_norm = _param(_ones, None, (n, d), pd, ("layers", "norm"))
        self.mlp_norm = _param(_ones, None, (n, e), pd, ("layers", "norm"))
        self.gate_kernel = _param(_normal, rngs.params(), (n, e, m), pd, ("layers", "embed", "mlp"))
        self.up_kernel = _param(_normal, rngs.params(), (n, e, m), pd, ("layers", "embed", "mlp"))
        self.down_kernel = _param(_normal, rngs.params(), (n, m, e), pd, ("layers", "mlp", "embed"))


class KVCache(NamedTuple):
    k: jax.Array        # [layers, slots, max_len, kv_heads, head_dim]
    v: jax.Array        # [layers, slots, max_len, kv_heads, head_dim]
    lengths: jax.Array  # int32 [slots]


def init_cache(cfg: DecoderConfig, num_slots: int, max_len: int, dtype=None) -> KVCache:
    """Zero cache for `num_slots` sequences of up to `max_len` tokens (dtype defaults to cfg.dtype)."""
    shape = (cfg.num_layers, num_slots, max_len, cfg.num_kv_heads, cfg.head_dim)
    dt = jnp.dtype(dtype or cfg.dtype)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.zeros((num_slots,), jnp.int32))


def reset_slots(cache: KVCache, slot_ids: jax.Array) -> KVCache:
    """Mark slots empty (their stale K/V is never read again, see the module docstring)."""
    return cache._replace(lengths=cache.lengths.at[slot_ids].set(0))


REMAT_POLICIES = ("none", "block", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "offload_dots")


def remat_policy_name(remat: bool | str) -> str:
    name = {True: "block", False: "none"}.get(remat, remat) if isinstance(remat, bool) else remat
    if name not in REMAT_POLICIES:
        raise ValueError(f"learner.remat: got {remat!r}, expected one of {REMAT_POLICIES}")
    return name


def apply_remat(body, name: str):
    """`body` under the named `jax.checkpoint` policy: "block" saves only the block's input,
    "dots_saveable" also every matmul output, "dots_with_no_batch_dims_saveable" the weight
    matmuls (not attention's batched ones), "offload_dots" moves those to host memory."""
    cp = jax.checkpoint_policies
    policies = {"block": None, "dots_saveable": cp.dots_saveable,
                "dots_with_no_batch_dims_saveable": cp.dots_with_no_batch_dims_saveable,
                "offload_dots": cp.offload_dot_with_no_batch_dims("device", "pinned_host")}
    if name == "none":
        return body
    return jax.checkpoint(body, policy=policies[name])


class TrainShardings(NamedTuple):
    """Where the training path puts its activations and gathered weights (FSDP), built by
    `learner.train_state.ShardedModel.train_shardings`.

    Without these, GSPMD propagates the params' `embed`-over-fsdp sharding into the activations
    and replicates the batch instead: every device then holds the whole micro-batch's MLP
    activations ([B, T, mlp] fp32, 10 GB per layer for Qwen2.5-7B at 18K tokens;
    experiments/memory_plan.py). Pinning activations to the batch axes and all-gathering each
    layer's weights (in the compute dtype) inside the layer loop is FSDP proper.
    """
    activations: object   # sharding of [B, T, hidden] (batch over the data axes)
    layer_params: dict    # param name -> sharding of one layer's slice, gathered over the data axes
    lm_head: object       # sharding of the gathered [hidden, vocab] kernel


def _exact_block(cfg, p, x, cos, sin, attend_fn):
    """`_block` with the token-wise halves in fixed-shape row blocks (`models.exact`)."""
    def pre(p, x, cos, sin):  # rows [R, ...]: the same layer code on a [1, R] "batch"
        h = L.rms_norm(x[None], p["attn_norm"], cfg.rms_norm_eps)
        return tuple(y[0] for y in L.qkv_projection(cfg, p, h, cos[None], sin[None]))

    def post(p, x, attn):
        x = x[None] + L.attention_output(p, attn[None])
        h = L.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        return (x + L.swiglu_mlp(p, h))[0]

    q, k, v = X.rowwise(pre)(p, x, cos, sin)
    attn, extra = attend_fn(q, k, v)
    return X.rowwise(post)(p, x, attn), extra


def _block(cfg, p, x, cos, sin, attend_fn, mlp_chunk: int = 0):
    """One pre-norm block; `attend_fn(q, k, v) -> attn` hides where keys come from;
    `mlp_chunk`: `layers.swiglu_mlp`'s sequence chunk (0 = whole)."""
    if cfg.attention == "exact":
        return _exact_block(cfg, p, x, cos, sin, attend_fn)
    h = L.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q, k, v = L.qkv_projection(cfg, p, h, cos, sin)
    attn, extra = attend_fn(q, k, v)
    x = x + L.attention_output(p, attn)
    h = L.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    return x + L.swiglu_mlp(p, h, chunk=mlp_chunk), extra


class Decoder(nnx.Module):
    """Decoder-only LM. `Decoder(cfg, rngs=nnx.Rngs(0), remat="none")`.

    `remat` (`learner.remat`) names the `jax.checkpoint` policy applied to each block
    (`REMAT_POLICIES`); `True` means "block" (recompute everything in the backward pass).
    `mlp_chunk` (`learner.mlp_chunk`): the training path's MLP runs over sequence chunks of that
    many tokens (`layers.swiglu_mlp`; 0 = the whole sequence at once).
    Attention is `cfg.attention` through `models.attention.attention`.
    """

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs | None = None, *, remat: bool | str = "none",
                 mlp_chunk: int = 0):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.remat = remat_policy_name(remat)
        if not isinstance(mlp_chunk, int) or mlp_chunk < 0:
            raise ValueError(f"learner.mlp_chunk: got {mlp_chunk!r}, expected an int >= 0 (0 = off)")
        self.mlp_chunk = mlp_chunk
        pd = jnp.dtype(cfg.param_dtype)
        self.embedding = _param(_normal, rngs.params(), (cfg.vocab_size, cfg.hidden_size), pd, ("vocab", "embed"))
        self.layers = DecoderLayers(cfg, rngs)
        self.final_norm = _param(_ones, None, (cfg.hidden_size,), pd, ("norm",))
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(_normal, rngs.params(), (cfg.hidden_size, cfg.vocab_size), pd, ("embed", "vocab"))

    # ------------------------------------------------------------------ helpers
    def _layer_params(self) -> dict:
        return {name: var.get_value() for name, var in vars(self.layers).items() if isinstance(var, nnx.Param)}

    def _embed(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding.get_value(), tokens, axis=0).astype(jnp.dtype(self.cfg.dtype))

    def lm_head_kernel(self) -> jax.Array:
        """[hidden, vocab] output projection (the transposed embedding when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embedding.get_value().T
        return self.lm_head.get_value()

    def _logits(self, hidden: jax.Array) -> jax.Array:
        kernel = self.lm_head_kernel().astype(hidden.dtype)
        return jnp.einsum("bte,ev->btv", hidden, kernel, preferred_element_type=jnp.float32)

    def _final(self, x: jax.Array) -> jax.Array:
        eps = self.cfg.rms_norm_eps
        if self.cfg.attention == "exact":
            return X.rowwise(lambda scale, rows: L.rms_norm(rows, scale, eps))(self.final_norm.get_value(), x)
        return L.rms_norm(x, self.final_norm.get_value(), eps)

    def exact_logits(self, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
        """fp32 (logits [..., vocab], log-sum-exp [...]) of hidden [..., hidden], batch-invariant
        (`models.exact.rowwise`): the one LM head the engine samples from and the learner scores
        with when `cfg.attention == "exact"` (rollout.zero_mismatch)."""
        def rows(kernel, h):
            z = jnp.einsum("te,ev->tv", h, kernel.astype(h.dtype), preferred_element_type=jnp.float32)
            return z, jax.nn.logsumexp(z, axis=-1)
        return X.rowwise(rows)(self.lm_head_kernel(), hidden)

    # ------------------------------------------------------------------ training / scoring path
    def hidden(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None, *,
               shardings: TrainShardings | None = None, layer_grad_acc=None) -> jax.Array:
        """Final-normed hidden states [B, T, hidden] (compute dtype).

        Attention is causal within a row and restricted to equal segment ids (packed sequences);
        segment id 0 is padding. `segment_ids=None`: one unpadded sequence per row. `shardings`
        (under jit on a mesh): activations and per-layer gathered weights are pinned to them.
        `layer_grad_acc` (gradient accumulation, `learner.train_step`): a tree like the layer
        params whose sum with their gradient is what the vjp returns for them; with remat
        "block" and matching dtypes it is summed in place (`scan_layers_into`), else added after.
        """
        cfg = self.cfg
        cos, sin = L.rope_cos_sin(cfg, positions)
        dt = jnp.dtype(cfg.dtype)

        def pin(x, sharding):
            return x if shardings is None else jax.lax.with_sharding_constraint(x, sharding)

        def attend(q, k, v):
            return A.attention(q, k, v, impl=cfg.attention, segment_ids=segment_ids), None

        def body(x, p):
            if shardings is not None:
                # Every layer op casts its weights to the compute dtype anyway (layers.py), so
                # gathering them already cast is the same maths at half the bytes moved.
                p = {k: pin(v.astype(dt), shardings.layer_params[k]) for k, v in p.items()}
                x = pin(x, shardings.activations)
            return _block(cfg, p, x, cos, sin, attend, mlp_chunk=self.mlp_chunk)

        act = None if shardings is None else shardings.activations
        x, layer_params = pin(self._embed(tokens), act), self._layer_params()
        if layer_grad_acc is not None and self.remat == "block" and all(
                a.dtype == p.dtype for a, p in zip(jax.tree.leaves(layer_grad_acc), jax.tree.leaves(layer_params))):
            x = scan_layers_into(body, x, layer_params, layer_grad_acc)
        else:
            if layer_grad_acc is not None:
                layer_params = add_to_grad(layer_params, layer_grad_acc)
            x, _ = jax.lax.scan(apply_remat(body, self.remat), x, layer_params)
        return pin(self._final(x), act)

    def __call__(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None, *,
                 shardings: TrainShardings | None = None) -> jax.Array:
        """fp32 logits [B, T, vocab]."""
        return self._logits(self.hidden(tokens, positions, segment_ids, shardings=shardings))

    # ------------------------------------------------------------------ rollout (KV-cache) path
    def hidden_cached(self, tokens, positions, cache: KVCache, slot_ids, valid) -> tuple[jax.Array, KVCache]:
        """Hidden states [S, T, hidden] of new tokens, writing their K/V into `cache` (module doc)."""
        cfg = self.cfg
        max_len = cache.k.shape[2]
        cos, sin = L.rope_cos_sin(cfg, positions)
        # Invalid tokens get an out-of-range index; scatter mode="drop" then writes nothing.
        write_pos = jnp.where(valid, positions, max_len)

        slots = slot_ids[:, None]

        def body(carry, layer):
            # The whole cache rides in the carry and is updated in place, one layer per step, so a
            # jitted call with the cache donated never holds a second copy of it.
            x, k_cache, v_cache = carry
            p, i = layer

            def attend_cached(q, k, v):
                kc = k_cache.at[i, slots, write_pos].set(k.astype(k_cache.dtype), mode="drop")
                vc = v_cache.at[i, slots, write_pos].set(v.astype(v_cache.dtype), mode="drop")
                k_slot = kc[i, slot_ids].astype(q.dtype)
                v_slot = vc[i, slot_ids].astype(q.dtype)
                out = A.attention(q, k_slot, v_slot, impl=cfg.attention, q_positions=positions)
                return out, (kc, vc)

            x, (k_cache, v_cache) = _block(cfg, p, x, cos, sin, attend_cached)
            return (x, k_cache, v_cache), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, k_new, v_new), _ = jax.lax.scan(
            body, (self._embed(tokens), cache.k, cache.v), (self._layer_params(), layer_ids))
        written = jnp.max(jnp.where(valid, positions + 1, 0), axis=1).astype(jnp.int32)
        lengths = cache.lengths.at[slot_ids].max(written)
        return self._final(x), KVCache(k_new, v_new, lengths)

    def forward_cached(self, tokens, positions, cache: KVCache, slot_ids, valid) -> tuple[jax.Array, KVCache]:
        """fp32 logits [S, T, vocab] of new tokens and the updated cache (module docstring)."""
        hidden, cache = self.hidden_cached(tokens, positions, cache, slot_ids, valid)
        return self._logits(hidden), cache


def from_params(cfg: DecoderConfig, params, *, remat: bool | str = "none") -> Decoder:
    """A Decoder holding `params` (pure dict, numpy or jax leaves), without a random init."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0), remat=remat))
    graphdef, state = nnx.split(abstract, nnx.Param)
    state.replace_by_pure_dict(jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)
