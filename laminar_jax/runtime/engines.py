"""Building a rollout's engine and tokenizer from the config (picklable factories for actors).

`EngineFactory(cfg, model_dir)(tensors, version)` makes the JAX continuous-batching engine on
the first weights a rollout pulls; `latency` wraps it so every step takes at least the decode
latency a `sim.models.DecodeModel` gives for its batch, plus the prefill of what it admits
(experiments/compare_modes.py: emulated accelerator-bound rollouts, every token still real).
"""
from __future__ import annotations

import os
import time
from typing import Any

PAGE_SIZE = 16


def model_config(cfg: Any, model_dir: str | None):
    from laminar_jax.models.config import DecoderConfig
    if model_dir:
        import json
        path = os.path.join(model_dir, "config.json")
        with open(path) as f:
            return DecoderConfig.from_hf(json.load(f), source=path, param_dtype=cfg.model.rollout_dtype,
                                         dtype=cfg.model.rollout_dtype, attention=cfg.model.attention)
    return DecoderConfig.from_model_section(cfg.model, dtype=cfg.model.rollout_dtype)


def tokenizer_for(model_dir: str | None):
    """The model folder's tokenizer.json, else the built-in tasks' character tokenizer."""
    if model_dir and os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        from laminar_jax.models.tokenizer import load_tokenizer
        return load_tokenizer(model_dir)
    from laminar_jax.data.char_tokenizer import CharTokenizer
    return CharTokenizer()


class LatencyEngine:
    """An engine whose `step()` lasts at least the emulated accelerator time of that step:

        model.step_latency(n, kv_tokens) + prefill_tokens * model.prefill_s_per_token

    n the sequences the step advances (running + admitted), kv_tokens their KV tokens, and
    prefill_tokens the context (prompt + any resumed prefix) of the requests the step admits: a
    fresh batch's prompts, and the re-prefill of trajectories a repack moved here (the cost of a
    move the paper measures as 0.69 s) or a preemption put back. The wrapped engine must keep
    its queue in `_waiting` (sequences with `.req.id` and `.context`), as `JaxEngine` does.
    """

    def __init__(self, engine: Any, model: Any):
        self._engine, self._model = engine, model
        self.prefill_tokens = 0

    def step(self):
        s = self._engine.stats()
        n = s.num_running + s.num_waiting
        waiting = {seq.req.id: seq.context for seq in getattr(self._engine, "_waiting", ())}
        start = time.perf_counter()
        out = self._engine.step()
        still = {seq.req.id for seq in getattr(self._engine, "_waiting", ())}
        prefill = sum(c for rid, c in waiting.items() if rid not in still)
        self.prefill_tokens += prefill
        target = (self._model.step_latency(min(n, len(self._model.alpha) - 1), s.kv_used_tokens)
                  + prefill * self._model.prefill_s_per_token) if n else 0.0
        left = target - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        return out

    def __getattr__(self, name):
        return getattr(self._engine, name)


class EngineFactory:
    def __init__(self, cfg: Any, model_dir: str | None, *, seed: int = 0, latency_model: Any = None):
        self.cfg, self.model_dir, self.seed, self.latency_model = cfg, model_dir, seed, latency_model

    def __call__(self, tensors: dict, version: int):
        from laminar_jax.models.hf import hf_to_params
        from laminar_jax.runtime import compile_cache
        from rollout.jax_engine import JaxEngine

        compile_cache.enable(self.cfg.run.compile_cache)

        mcfg = model_config(self.cfg, self.model_dir)
        r = self.cfg.rollout
        max_len = min(mcfg.max_position_embeddings, self.cfg.learner.max_seq_len)
        pages_per_seq = -(-max_len // PAGE_SIZE)
        engine = JaxEngine(mcfg, hf_to_params(mcfg, tensors, source=f"weights v{version}"),
                           max_num_seqs=r.max_concurrency, max_model_len=max_len, page_size=PAGE_SIZE,
                           num_pages=max(pages_per_seq, r.kv_budget_tokens // PAGE_SIZE),
                           min_rows=r.max_concurrency, min_window_pages=pages_per_seq,
                           weight_version=version, seed=self.seed)
        return engine if self.latency_model is None else LatencyEngine(engine, self.latency_model)
