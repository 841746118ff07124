"""Per-token log-probs (and entropies) of packed or padded sequences, chunked over the sequence.

For hidden states h_t and the LM head W (``[hidden, vocab]``):

    z_t      = h_t W / temperature
    logp_t   = z_t[y_t] - logsumexp(z_t)
    H_t      = logsumexp(z_t) - sum_v softmax(z_t)_v z_t[v]

Full-vocabulary fp32 logits ``[B, T, V]`` would dominate learner memory (for B=64, T=4096,
V=152k that is 160 GB), so the positions are processed ``chunk_size`` at a time with ``lax.map``;
each chunk is rematerialised in the backward pass (``jax.checkpoint``), so at most one chunk of
logits ``[B, chunk, V]`` is alive in the forward or the backward pass.
"""
from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp

from laminar_jax import sharding as shd


def chunked_token_logprobs(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, *,
                           chunk_size: int = 128, temperature: float = 1.0,
                           with_entropy: bool = False, exact_head: Any = None) -> tuple[jax.Array, jax.Array | None]:
    """``logp[b, t] = log softmax(hidden[b, t] @ lm_head / temperature)[targets[b, t]]``.

    ``exact_head(h) -> (logits, lse)`` (``Decoder.exact_logits``, rollout.zero_mismatch) replaces
    the matmul and log-sum-exp with the engine's batch-invariant ones (temperature 1 only).

    hidden ``[B, T, H]`` (any float dtype; the matmul accumulates in fp32), lm_head ``[H, V]``,
    targets int ``[B, T]``. Returns fp32 ``logp [B, T]`` and, with ``with_entropy``, the fp32
    entropy ``[B, T]`` of the same distributions (else ``None``).
    """
    chex.assert_rank([hidden, lm_head, targets], [3, 2, 2])
    chex.assert_equal_shape_prefix([hidden, targets], 2)
    chex.assert_type(targets, int)
    if hidden.shape[-1] != lm_head.shape[0]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != lm_head rows {lm_head.shape[0]}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, t, h = hidden.shape
    c = min(chunk_size, t)
    n = -(-t // c)
    pad = n * c - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hs = jnp.moveaxis(hidden.reshape(b, n, c, h), 1, 0)       # [n, B, c, H]
    ys = jnp.moveaxis(targets.reshape(b, n, c), 1, 0)         # [n, B, c]
    inv_temp = 1.0 / temperature
    if exact_head is not None and temperature != 1.0:
        raise ValueError(f"chunked_token_logprobs: exact_head scores at temperature 1, got {temperature}")

    @jax.checkpoint
    def chunk(args):
        hc, yc = args
        if exact_head is not None:
            z, lse = exact_head(hc)
        else:
            z = jnp.einsum("bch,hv->bcv", hc, lm_head.astype(hc.dtype),
                           preferred_element_type=jnp.float32) * inv_temp
            lse = jax.nn.logsumexp(z, axis=-1)
        logp = jnp.take_along_axis(z, yc[..., None].astype(jnp.int32), axis=-1)[..., 0] - lse
        if not with_entropy:
            return (logp,)
        probs = jnp.exp(z - lse[..., None])
        return logp, lse - jnp.sum(probs * z, axis=-1)

    outs = jax.lax.map(chunk, (hs, ys))
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, n * c)[:, :t]  # noqa: E731
    return unchunk(outs[0]), (unchunk(outs[1]) if with_entropy else None)


def next_token_mask(segment_ids: jax.Array) -> jax.Array:
    """bool ``[B, L]``: token t has a predecessor in its own (non-padding) segment."""
    same = segment_ids[:, 1:] == segment_ids[:, :-1]
    real = segment_ids[:, 1:] != 0
    return jnp.pad(same & real, ((0, 0), (1, 0)))


def sequence_logprobs(model: Any, tokens: jax.Array, positions: jax.Array,
                      segment_ids: jax.Array | None = None, *,
                      response_mask: jax.Array | None = None, chunk_size: int = 128,
                      temperature: float = 1.0, with_entropy: bool = False,
                      shardings: Any = None, layer_grad_acc: Any = None) -> tuple[jax.Array, jax.Array | None]:
    """Log-probs of each token given its prefix, aligned with ``tokens``.

    ``logp[b, t] = log p(tokens[b, t] | tokens[b, s < t] of the same segment)``; it is 0 at the
    first token of every segment, at padding (segment 0) and, when ``response_mask`` is given,
    wherever the mask is 0 (prompt tokens). The same holds for the optional entropy, which is the
    entropy of the distribution token t was drawn from. ``model`` needs ``hidden(tokens, positions,
    segment_ids)`` and ``lm_head_kernel()`` (``models.decoder.Decoder``). ``shardings``: the
    model's ``models.decoder.TrainShardings`` on a mesh (``ShardedModel.train_shardings()``), so
    activations, logits chunks and gathered weights stay split over the batch axes (FSDP).
    ``layer_grad_acc``: the gradient accumulator of the layer params, passed to
    ``model.hidden`` (``learner.train_step.accumulate_gradients``).
    """
    chex.assert_rank([tokens, positions], 2)
    chex.assert_equal_shape([tokens, positions])
    if segment_ids is None:
        valid = jnp.pad(jnp.ones((tokens.shape[0], tokens.shape[1] - 1), bool), ((0, 0), (1, 0)))
    else:
        chex.assert_equal_shape([tokens, segment_ids])
        valid = next_token_mask(segment_ids)
    if response_mask is not None:
        chex.assert_equal_shape([tokens, response_mask])
        valid = valid & (response_mask != 0)
    acc = {} if layer_grad_acc is None else {"layer_grad_acc": layer_grad_acc}
    if shardings is None:
        hidden, head = model.hidden(tokens, positions, segment_ids, **acc), model.lm_head_kernel()
    else:
        hidden = model.hidden(tokens, positions, segment_ids, shardings=shardings, **acc)
        # gathered once in the compute dtype (the chunks cast it to that anyway)
        head = jax.lax.with_sharding_constraint(model.lm_head_kernel().astype(hidden.dtype),
                                                shardings.lm_head)
    exact = getattr(getattr(model, "cfg", None), "attention", None) == "exact"
    exact_head = model.exact_logits if exact else None
    logp, ent = chunked_token_logprobs(hidden[:, :-1], head, tokens[:, 1:],
                                       chunk_size=chunk_size, temperature=temperature,
                                       with_entropy=with_entropy, exact_head=exact_head)
    shift = lambda x: jnp.where(valid, jnp.pad(x, ((0, 0), (1, 0))), 0.0)  # noqa: E731
    return shift(logp), (shift(ent) if with_entropy else None)


def make_logprobs_fn(sharded: Any, *, chunk_size: int = 128, temperature: float = 1.0,
                     with_entropy: bool = False):
    """Jitted ``fn(params, tokens, positions, segment_ids, response_mask) -> (logp, entropy)``
    on ``sharded.mesh`` (a ``train_state.ShardedModel``): params by their rules, batch arrays
    split over the batch axes. ``entropy`` is ``None`` unless ``with_entropy``."""
    batch_sh = shd.batch_sharding(sharded.mesh, 2, sharded.rules)
    shardings = sharded.train_shardings()

    def fn(params, tokens, positions, segment_ids, response_mask):
        return sequence_logprobs(sharded.bind(params), tokens, positions, segment_ids,
                                 response_mask=response_mask, chunk_size=chunk_size,
                                 temperature=temperature, with_entropy=with_entropy,
                                 shardings=shardings)
    out_sh = (batch_sh, batch_sh if with_entropy else None)
    return jax.jit(fn, in_shardings=(sharded.param_shardings,) + (batch_sh,) * 4,
                   out_shardings=out_sh)
