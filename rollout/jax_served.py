"""The JAX engine's decoder on the weight layout the relays serve (Hugging Face's), so that a
version switch is one plain copy of the weights.

The relays carry each version in the Hugging Face layout (`weights.flat`), which vLLM loads as
it is. The learner's decoder keeps its projection kernels as [in, heads, head_dim]
(`models.decoder`), so an engine on that layout transposes ~80% of the bytes at every switch:
~5 plain copies' worth of time on a CPU (`experiments/bench_engine.py`). `ServedDecoder` is the
same model, the same maths (`models.layers` contracts each projection on its served axes), with
the projection kernels and an untied LM head stored as served, stacked on the layer axis:

    layers/q_proj    [L, H*D, E]     layers/k_proj, v_proj  [L, K*D, E]
    layers/o_proj    [L, E, H*D]     layers/gate_proj, up_proj [L, M, E]
    layers/down_proj [L, E, M]       lm_head [V, E] (untied only)

Everything else (embedding, norms, biases) is the decoder's own leaf, whose slot a served tensor
fills by a plain copy (a bias [H*D] is its [H, D] slot, reshaped). `served_map(cfg)` is the
name map onto these leaves (every transform an identity or a reshape), which
`rollout.jax_weights.WeightPlan` turns into the copy plan.

The learner's params and checkpoints keep the decoder layout; only the engine holds this one.
Zero-mismatch mode (`attention: exact`) stays on the decoder layout: bit-identity with the
learner's recompute needs the same operand layouts in every matmul.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder, DecoderLayers
from laminar_jax.models.hf import Entry, name_map

# decoder leaf -> the served leaf that replaces it (the HF module's name)
SERVED_KERNELS = {"q_kernel": "q_proj", "k_kernel": "k_proj", "v_kernel": "v_proj", "o_kernel": "o_proj",
                  "gate_kernel": "gate_proj", "up_kernel": "up_proj", "down_kernel": "down_proj"}
_NAMES = {"q_proj": ("layers", "heads", "embed"), "k_proj": ("layers", "kv_heads", "embed"),
          "v_proj": ("layers", "kv_heads", "embed"), "o_proj": ("layers", "embed", "heads"),
          "gate_proj": ("layers", "mlp", "embed"), "up_proj": ("layers", "mlp", "embed"),
          "down_proj": ("layers", "embed", "mlp")}


def _ident(x):
    return x


def served_map(cfg: DecoderConfig) -> list[Entry]:
    """`models.hf.name_map` onto `ServedDecoder`'s leaves: kernels and an untied head move to
    their served leaf with identity transforms; the other entries are unchanged."""
    out = []
    for e in name_map(cfg):
        if e.path[-1] in SERVED_KERNELS:
            e = dataclasses.replace(e, path=("layers", SERVED_KERNELS[e.path[-1]]), to_hf=_ident, from_hf=_ident)
        elif e.path == ("lm_head",):
            e = dataclasses.replace(e, to_hf=_ident, from_hf=_ident)
        out.append(e)
    return out


class ServedLayers(nnx.Module):
    """`DecoderLayers` with the projection kernels in the served layout (module docstring)."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        shapes = {e.path[1]: e.hf_shape for e in served_map(cfg) if e.layer == 0 and e.path[1] in _NAMES}
        base = DecoderLayers(cfg, rngs)       # the norms and biases, as the decoder makes them
        init = jax.nn.initializers.normal(0.02)
        for name, var in vars(base).items():
            if not isinstance(var, nnx.Param):
                continue
            if name in SERVED_KERNELS:
                served = SERVED_KERNELS[name]
                shape = (cfg.num_layers, *shapes[served])
                value = init(rngs.params(), shape, jnp.dtype(cfg.param_dtype))
                setattr(self, served, nnx.Param(value, out_sharding=_NAMES[served], eager_sharding=False))
            else:
                setattr(self, name, var)


class ServedDecoder(Decoder):
    """`Decoder` whose layer kernels and untied LM head are in the served layout. Built abstractly
    by the engine (`nnx.eval_shape`) and filled by `WeightPlan`; the forward paths are Decoder's."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        super().__init__(cfg, rngs)
        self.layers = ServedLayers(cfg, rngs)
        if not cfg.tie_word_embeddings:
            init = jax.nn.initializers.normal(0.02)
            self.lm_head = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.dtype(cfg.param_dtype)),
                                     out_sharding=("vocab", "embed"), eager_sharding=False)

    def lm_head_kernel(self) -> jax.Array:
        """[hidden, vocab], as the decoder's: a transpose that XLA folds into the matmul (the same
        as a tied head's `embedding.T`)."""
        if self.cfg.tie_word_embeddings:
            return super().lm_head_kernel()
        return self.lm_head.get_value().T
