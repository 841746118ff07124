"""Building a rollout's engine and tokenizer from the config (picklable factories for actors).

`EngineFactory(cfg, model_dir)(tensors, version)` makes the JAX continuous-batching engine on
the first weights a rollout pulls; `latency` wraps it so every step takes at least the decode
latency a `sim.models.DecodeModel` gives for its batch (experiments/compare_modes.py: emulated
accelerator-bound rollouts, every token still real).
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
                                         dtype=cfg.model.rollout_dtype)
    return DecoderConfig.from_model_section(cfg.model, dtype=cfg.model.rollout_dtype)


def tokenizer_for(model_dir: str | None):
    """The model folder's tokenizer.json, else the built-in tasks' character tokenizer."""
    if model_dir and os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        from laminar_jax.models.tokenizer import load_tokenizer
        return load_tokenizer(model_dir)
    from laminar_jax.data.char_tokenizer import CharTokenizer
    return CharTokenizer()


class LatencyEngine:
    """An engine whose `step()` lasts at least `model.step_latency(running, kv_tokens)` seconds."""

    def __init__(self, engine: Any, model: Any):
        self._engine, self._model = engine, model

    def step(self):
        s = self._engine.stats()
        target = self._model.step_latency(min(s.num_running + s.num_waiting, len(self._model.alpha) - 1),
                                          s.kv_used_tokens) if s.num_running + s.num_waiting else 0.0
        start = time.perf_counter()
        out = self._engine.step()
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
        from rollout.jax_engine import JaxEngine

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
