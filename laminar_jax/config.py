"""The run configuration: one frozen dataclass per section, read from YAML.

`load_config("configs/default.yaml", ["optimizer.lr=1e-4"])` returns a `Config`; every field has
a default (the tiny CPU run), so a YAML file lists only what it changes. Each section checks its
ranges in `__post_init__`; `laminar_jax.config_loader` adds the file and dotted key to the error.

No jax import: `laminar config show` and argument errors must stay instant.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

from laminar_jax.config_loader import (ConfigError, config_from_dict, dump_config, dump_yaml,
                                       load_config, yaml_load)
from laminar_jax.config_loader import check_at_least as _at_least
from laminar_jax.config_loader import check_non_negative as _non_negative
from laminar_jax.config_loader import check_positive as _positive
from laminar_jax.config_loader import require as _require
from laminar_jax.rl.spec import AdvantageSpec, CorrectionSpec, LossSpec
from laminar_jax.manager.modes import Mode  # the mode Literal, derived from MODE_RULES

__all__ = [
    "AdvantageSpec", "Config", "ConfigError", "DataConfig", "EnvConfig", "LearnerConfig", "LossSpec",
    "ManagerConfig", "MeshConfig", "ModelConfig", "OptimizerConfig", "PoolConfig", "RelayConfig",
    "RewardConfig", "RolloutConfig", "RunConfig", "SftConfig", "config_from_dict", "dump_config",
    "dump_yaml", "load_config", "yaml_load",
]

DType = Literal["float32", "bfloat16", "float16"]


def _non_empty(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        _require(v is None or v.strip() != "", name, v, "a non-empty string")


@dataclass(frozen=True)
class RunConfig:
    """Where the run folder goes (`out_dir/name`), how long it runs and how often it logs.

    ray_address: None starts an embedded local Ray cluster; "auto" or "host:port" joins one.
    checkpoint_every / checkpoint_every_s: an orbax checkpoint every that many learner steps or
    seconds, whichever comes first (0 turns that trigger off; both 0: only at the end), so a
    crash loses at most about checkpoint_every_s of work.
    resume: what an existing run folder means. auto: resume its latest checkpoint when it was
    made with the same config (run.steps, logging and checkpoint cadence may differ), refuse when
    the config differs; never: refuse any folder that holds a run; force: resume even with a
    different config (the old config.yaml is kept as config.<time>.yaml).
    trackers: where metrics also go besides the Parquet files: tensorboard (tb/), wandb (offline
    unless WANDB_MODE says otherwise, under wandb/).
    compile_cache: folder of the persistent JAX compilation cache shared by every run and
      process ("~" expanded; None turns it off); a warm cache skips the compiles at start-up.
    colocate: run the learner and the one rollout in the driver's process (`runtime.colocated`):
      no Ray, no relay, weights handed over in memory. For small single-node runs, where Ray's
      start and the publish-to-pull chain cost more than they save; no rollout manager (no
      failover, heartbeats or repack). Needs one JAX rollout, one learner host on one device
      and no ray_address.
    """

    name: str = "default"
    out_dir: str = "runs"
    seed: int = 0
    steps: int = 60
    log_every: int = 1
    ray_address: str | None = None
    checkpoint_every: int = 20
    checkpoint_every_s: float = 300.0
    resume: Literal["auto", "never", "force"] = "auto"
    trackers: tuple[str, ...] = ("tensorboard",)
    compile_cache: str | None = "~/.cache/laminar/jax"
    colocate: bool = False

    def __post_init__(self):
        _non_empty(self, "name", "out_dir", "ray_address", "compile_cache")
        _require("/" not in self.name and self.name not in (".", ".."), "name", self.name,
                 "a folder name without '/'")
        _at_least(self, 0, "seed", "checkpoint_every")
        _non_negative(self, "checkpoint_every_s")
        _at_least(self, 1, "steps", "log_every")
        _require(all(t in _TRACKERS for t in self.trackers) and len(set(self.trackers)) == len(self.trackers),
                 "trackers", list(self.trackers), f"a list of distinct names among {list(_TRACKERS)}")


_TRACKERS = ("tensorboard", "wandb")


@dataclass(frozen=True)
class ModelConfig:
    """The policy: a built-in preset, or a Hugging Face folder (config.json + safetensors).

    hf_path wins over preset when set. vocab_size resizes a preset's vocabulary (0 keeps the
    preset's; a Hugging Face folder brings its own): 128 covers the built-in tasks' character
    tokenizer (99 ids), so the policy spends no probability on ids it can never decode. param_dtype is the learner's master copy,
    dtype its compute dtype, rollout_dtype what the relays ship to the engines.
    """

    preset: Literal["tiny", "100m"] = "tiny"
    hf_path: str | None = None
    vocab_size: int = 128
    param_dtype: DType = "float32"
    dtype: DType = "float32"
    rollout_dtype: DType = "float32"
    # models.attention: auto = cudnn on GPU, splash on TPU, blockwise (flash-style XLA) elsewhere;
    # exact = batch-invariant decoder (models.exact), what rollout.zero_mismatch switches on
    attention: Literal["auto", "blockwise", "cudnn", "splash", "naive", "exact"] = "auto"

    def __post_init__(self):
        _non_empty(self, "hf_path")
        _non_negative(self, "vocab_size")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping and a warmup + decay schedule (optax).

    grad_clip: max global gradient norm (0 = no clipping). The schedule decays from lr to
    lr * min_lr_ratio over run.steps after warmup_steps of linear warmup.
    """

    lr: float = 3e-4
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    min_lr_ratio: float = 0.1
    state_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self):
        _positive(self, "lr", "eps")
        _non_negative(self, "weight_decay", "grad_clip")
        for name in ("b1", "b2"):
            v = getattr(self, name)
            _require(0 <= v < 1, name, v, "0 <= value < 1")
        _at_least(self, 0, "warmup_steps")
        _require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "0 <= ratio <= 1")


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh of the learner, axes ("data", "fsdp", "tensor").

    data = -1 takes all devices left after fsdp * tensor.
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        _require(self.data == -1 or self.data >= 1, "data", self.data,
                 "an int >= 1, or -1 for all remaining devices")
        _at_least(self, 1, "fsdp", "tensor")


@dataclass(frozen=True)
class LearnerConfig:
    """One learner step: global_batch_groups prompt groups, split into mini_batches updates.

    micro_batch_size: sequences per gradient-accumulation micro-batch (0 = whole mini-batch).
    max_seq_len: prompt + response tokens per packed row. logprob_chunk: sequence chunk of the
    log-prob computation (bounds the [chunk, vocab] logits held at once).
    recompute_prox: recompute prox_logp even when the loss does not need it (for metrics).
    pack: first-fit-decreasing packing of trajectories into rows of max_seq_len (segment ids);
    row counts come from a few buckets. Unpacked, a row is the batch's longest trajectory rounded
    up to a length bucket: min_bucket * 2^k, capped at max_seq_len (runtime.batch).
    remat: jax.checkpoint policy per decoder block (models.decoder.REMAT_POLICIES).
    mlp_chunk: tokens per chunk of each block's MLP in the learner (0 = the whole row at once);
    bounds the [tokens, intermediate] activations, the largest per-layer temporaries at long
    max_seq_len (models.layers.swiglu_mlp, experiments/memory_plan.py).
    precompile: compile every bucket's train step in the background at start-up.
    memory_fraction: null (JAX's defaults) or the share of its accelerator's memory the learner
    preallocates (XLA_PYTHON_CLIENT_MEM_FRACTION, XLA_PYTHON_CLIENT_PREALLOCATE=true in the learner
    actor's environment). With one learner device it is also the learner's Ray GPU share, so a
    vLLM rollout with a fractional GPU can sit on the same GPU (their memory must sum to <= 1).
    mismatch_versions: past versions whose params the learner keeps (one copy each) so the
    engines' mismatch metrics also cover tokens up to that many versions stale; 0 = the fresh
    tokens only (runtime.engine_metrics).
    hosts: learner processes, one per host (placement-group bundle), joined by jax.distributed into
    one global mesh (runtime.learner_group); the mesh's devices split evenly over them.
    """

    global_batch_groups: int = 8
    mini_batches: int = 1
    micro_batch_size: int = 0
    max_seq_len: int = 256
    logprob_chunk: int = 128
    recompute_prox: bool = False
    pack: bool = False
    min_bucket: int = 64
    remat: Literal["none", "block", "dots_saveable", "dots_with_no_batch_dims_saveable",
                   "offload_dots"] = "none"
    precompile: bool = True
    memory_fraction: float | None = None
    mismatch_versions: int = 0
    mlp_chunk: int = 0
    hosts: int = 1

    def __post_init__(self):
        _at_least(self, 1, "hosts")
        _require(self.memory_fraction is None or 0 < self.memory_fraction <= 1, "memory_fraction",
                 self.memory_fraction, "null or a fraction in (0, 1]")
        _at_least(self, 1, "global_batch_groups", "mini_batches", "max_seq_len", "logprob_chunk",
                  "min_bucket")
        _at_least(self, 0, "micro_batch_size", "mismatch_versions", "mlp_chunk")
        _require(self.global_batch_groups % self.mini_batches == 0, "mini_batches",
                 self.mini_batches,
                 f"a divisor of global_batch_groups ({self.global_batch_groups})")


@dataclass(frozen=True)
class SftConfig:
    """Supervised warm-up on the task's reference answers (next-token cross-entropy).

    demo_noise: the chance of a mistake at each step of a demonstration (countdown skips a
    number, arithmetic is off by one), so the warm-up policy is imperfect the way SFT on
    imperfect data is, and RL has errors to remove; 0 gives clean demonstrations.
    """

    steps: int = 300
    batch_size: int = 32
    seq_len: int = 64
    lr: float = 3e-3
    demo_noise: float = 0.2

    def __post_init__(self):
        _at_least(self, 1, "steps", "batch_size")
        _at_least(self, 2, "seq_len")
        _positive(self, "lr")
        _non_negative(self, "demo_noise")
        _require(self.demo_noise < 1, "demo_noise", self.demo_noise, "a number in [0, 1)")


Engine = Literal["jax", "vllm"]


def _fraction_or_null(obj, name: str) -> None:
    v = getattr(obj, name)
    _require(v is None or 0 < v <= 1, name, v, "null or a fraction in (0, 1]")


def vllm_memory_share(pool: "PoolConfig") -> float | None:
    """The share of a GPU's memory a vLLM rollout of `pool` (resolved) takes: its
    gpu_memory_utilization, else a fractional accelerators_per_rollout, else None (vLLM's default)."""
    if pool.gpu_memory_utilization is not None:
        return pool.gpu_memory_utilization
    a = pool.accelerators_per_rollout or 0.0
    return float(a) if 0 < a < 1 else None


@dataclass(frozen=True)
class PoolConfig:
    """One pool of identical rollouts (an item of `rollout.pools`).

    A field left null takes the `rollout.*` value of the same name (the short form's), so a pool
    lists only what differs. name: a label for metrics, events and trajectories (default
    "pool<i>"). accelerators_per_rollout: Ray GPU/TPU resources of each rollout of the pool
    (vLLM's tensor_parallel_size is its whole part, at least 1). gpu_memory_utilization: vLLM's
    share of each GPU's memory (null: the fractional accelerators_per_rollout, else vLLM's default).
    """

    name: str | None = None
    engine: Engine | None = None
    num_rollouts: int = 1
    accelerators_per_rollout: float | None = None
    max_concurrency: int | None = None
    kv_budget_tokens: int | None = None
    gpu_memory_utilization: float | None = None

    def __post_init__(self):
        _non_empty(self, "name")
        _fraction_or_null(self, "gpu_memory_utilization")
        _at_least(self, 1, "num_rollouts")
        for name in ("max_concurrency", "kv_budget_tokens"):
            v = getattr(self, name)
            _require(v is None or v >= 1, name, v, "null or an int >= 1")
        v = self.accelerators_per_rollout
        _require(v is None or v >= 0, "accelerators_per_rollout", v, "null or a number >= 0")


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout workers and sampling.

    temperature 0 is greedy; top_k 0 disables top-k. engine: "jax" (the embedded JAX engine) or
    "vllm" (needs the vllm extra). kv_budget_tokens: KV-cache capacity of one rollout's engine in
    tokens (the repack plan's KV use is relative to it). accelerators_per_rollout: Ray GPU/TPU
    resources each worker asks for (0 on CPU). gpu_memory_utilization: vLLM's share of each GPU's
    memory (null: a fractional accelerators_per_rollout, else vLLM's default).

    zero_mismatch: the JAX engine and the learner both run the batch-invariant decoder
    (`model.attention: exact`, `laminar_jax.models.exact`), so the engine's behaviour log-probs are
    bit-identical to the learner's recompute of the same tokens at the same version, and tokens
    are sampled from exactly those probabilities. Needs engine jax in every pool, temperature 1,
    no top-k/top-p, and model.rollout_dtype == model.dtype (checked in `Config`).

    pools: several pools of rollouts in one run, e.g. vLLM rollouts on GPU nodes next to JAX
    rollouts (`PoolConfig`); empty = one pool made of the keys above (the short form). With pools,
    num_rollouts must be their total. `pools_resolved()` / `assignments()` are the one place
    either form is read.
    """

    engine: Engine = "jax"
    num_rollouts: int = 2
    max_concurrency: int = 32
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    kv_budget_tokens: int = 8192
    accelerators_per_rollout: float = 0.0
    gpu_memory_utilization: float | None = None
    pools: tuple[PoolConfig, ...] = ()
    zero_mismatch: bool = False

    def __post_init__(self):
        _fraction_or_null(self, "gpu_memory_utilization")
        _at_least(self, 1, "num_rollouts", "max_concurrency", "max_new_tokens", "kv_budget_tokens")
        _at_least(self, 0, "top_k")
        _non_negative(self, "temperature", "accelerators_per_rollout")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "0 < top_p <= 1")
        if self.pools:
            total = sum(p.num_rollouts for p in self.pools)
            _require(self.num_rollouts == total, "num_rollouts", self.num_rollouts,
                     f"the total of rollout.pools ({total}: "
                     + " + ".join(str(p.num_rollouts) for p in self.pools) + ")")
            names = [p.name for p in self.pools_resolved()]
            dup = sorted({n for n in names if names.count(n) > 1})
            _require(not dup, "pools", [p.name for p in self.pools], f"unique pool names (repeated: {dup})")

    def pools_resolved(self) -> tuple[PoolConfig, ...]:
        """Every pool with each field filled in (null -> the rollout.* value)."""
        if not self.pools:
            return (PoolConfig(name="pool0", engine=self.engine, num_rollouts=self.num_rollouts,
                               accelerators_per_rollout=self.accelerators_per_rollout,
                               max_concurrency=self.max_concurrency, kv_budget_tokens=self.kv_budget_tokens,
                               gpu_memory_utilization=self.gpu_memory_utilization),)
        out = []
        for i, p in enumerate(self.pools):
            fill = {k: getattr(self, k) for k in ("engine", "accelerators_per_rollout", "max_concurrency",
                                                 "kv_budget_tokens", "gpu_memory_utilization")
                    if getattr(p, k) is None}
            out.append(dataclasses.replace(p, name=p.name or f"pool{i}", **fill))
        return tuple(out)

    def assignments(self) -> tuple[tuple[str, PoolConfig], ...]:
        """(rollout id, its resolved pool) of every rollout: rollout-0, rollout-1, ... in pool order."""
        out, i = [], 0
        for p in self.pools_resolved():
            for _ in range(p.num_rollouts):
                out.append((f"rollout-{i}", p))
                i += 1
        return tuple(out)

    def for_pool(self, pool: PoolConfig) -> "RolloutConfig":
        """This section in the short form of one pool (what a rollout of that pool runs with)."""
        return dataclasses.replace(self, engine=pool.engine, num_rollouts=pool.num_rollouts,
                                   accelerators_per_rollout=pool.accelerators_per_rollout,
                                   max_concurrency=pool.max_concurrency,
                                   kv_budget_tokens=pool.kv_budget_tokens,
                                   gpu_memory_utilization=pool.gpu_memory_utilization, pools=())


@dataclass(frozen=True)
class RelayConfig:
    """Relay tier: weights go learner -> master relay -> chain -> rollouts, in chunks.

    num_chunks 0 picks the chunk count that minimises the chain time model with t_byte_s (seconds
    per byte on a link) and t_start_s (fixed cost per chunk). enabled=False makes rollouts read
    the weight store directly (the ablation without relays). transport: how chunks go from relay
    to relay, "tcp" (a direct stream per link, received into the version buffer and forwarded
    from it) or "object_store" (Ray's); stream_timeout_s bounds a connect, a chunk's send and a
    read inside a frame, so a dead peer is an event, not a hang. shared_memory: version buffers
    in shared memory (Linux memfd), which rollouts map read-only instead of reading an
    object-store copy, and which relays on one host share (one copy per host, every relay checks
    every chunk) instead of streaming the bytes (relays on other hosts still get bytes over the
    transport); false serves every version through the node's object store.
    """

    enabled: bool = True
    num_chunks: int = 0
    store_dir: str = "/dev/shm/laminar"
    t_byte_s: float = 1e-9
    t_start_s: float = 1e-3
    transport: Literal["tcp", "object_store"] = "tcp"
    stream_timeout_s: float = 60.0
    shared_memory: bool = True
    idle_timeout_s: float = 300.0
    max_connections: int = 64
    check_interval_s: float = 1.0
    max_restarts: int = 3

    def __post_init__(self):
        _at_least(self, 0, "num_chunks", "max_restarts")
        _at_least(self, 1, "max_connections")
        _non_empty(self, "store_dir")
        _positive(self, "t_byte_s", "stream_timeout_s", "idle_timeout_s", "check_interval_s")
        _non_negative(self, "t_start_s")


@dataclass(frozen=True)
class ManagerConfig:
    """Scheduling mode and the rollout manager (paper sections 3-5).

    repack: move trajectories off rollouts whose KV use is falling below their batch's peak
    (Algorithm 1), checked every repack_interval_s; c_max caps a destination's KV use,
    roofline_batch is the batch at which decode stops being memory-bound (capped at
    rollout.max_concurrency, the most one engine runs at once). max_staleness bounds gen_version lag in "stream"/"partial".
    A worker silent for heartbeat_timeout_s is declared dead (startup_grace_s before it first
    reports weights: its first compile), and replaced by a new one, at most max_restarts times
    in the run. liveness_timeout_s: the run stops with an error when the learner has waited this
    long while no rollout delivered, rejected or streamed anything (no rollout alive and none
    restartable, prompts exhausted, or every prompt rejected stop it at once). A consumed
    trajectory staler than the mode's bound (laminar: max_staleness) is a warning.
    """

    mode: Mode = "laminar"  # the modes of manager.modes.MODE_RULES
    repack: bool = True
    repack_interval_s: float = 5.0
    c_max: float = 0.99
    roofline_batch: int = 64
    max_staleness: int = 4
    heartbeat_s: float = 2.0
    heartbeat_timeout_s: float = 30.0
    startup_grace_s: float = 600.0
    max_restarts: int = 3
    liveness_timeout_s: float = 60.0

    def __post_init__(self):
        _positive(self, "repack_interval_s", "heartbeat_s", "heartbeat_timeout_s", "startup_grace_s",
                  "liveness_timeout_s")
        _at_least(self, 0, "max_restarts")
        _require(0 < self.c_max <= 1, "c_max", self.c_max, "0 < c_max <= 1")
        _at_least(self, 1, "roofline_batch")
        _at_least(self, 0, "max_staleness")
        _require(self.heartbeat_timeout_s > self.heartbeat_s, "heartbeat_timeout_s",
                 self.heartbeat_timeout_s, f"more than heartbeat_s ({self.heartbeat_s})")


@dataclass(frozen=True)
class DataConfig:
    """Prompts, the prompt pool, the partial-response pool and the experience buffer.

    Prompts: the JSONL / Parquet file at path when set (task is then only a label, e.g. "math"),
    else the built-in task named by task ("synthetic" = "countdown", "arithmetic"), num_prompts
    of them with numbers up to task_max_n (0 = the task's default).
    group_size: responses sampled per prompt (the GRPO group).
    chat_template: wrap prompts with the tokenizer's chat template.
    shuffle / max_epochs: seeded order of each pass; stop after max_epochs passes (0 = forever).
    buffer_*: experience-buffer capacity in groups, sampler ("fifo" | "newest" | "uniform" |
    "pkg.module:Factory"), what a full buffer does ("block" = back-pressure, "drop_oldest",
    "drop_stalest" or an import path), and the staleness filter (drop groups more than this many
    versions behind the learner; null = off).
    partial_every_tokens / partial_every_s: how often rollouts stream in-flight tokens to the
    partial-response pool (whichever comes first).
    """

    task: str = "synthetic"
    path: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    id_field: str = "id"
    group_size: int = 8
    chat_template: bool = False
    num_prompts: int = 2048
    task_max_n: int = 0
    shuffle: bool = True
    max_epochs: int = 0
    buffer_groups: int = 8
    buffer_sampler: str = "fifo"
    buffer_when_full: str = "block"
    buffer_max_staleness: int | None = None
    partial_every_tokens: int = 16
    partial_every_s: float = 2.0

    def __post_init__(self):
        _non_empty(self, "task", "path", "prompt_field", "answer_field", "id_field")
        _at_least(self, 1, "group_size", "num_prompts", "buffer_groups", "partial_every_tokens")
        _at_least(self, 0, "task_max_n", "max_epochs")
        _require(self.buffer_max_staleness is None or self.buffer_max_staleness >= 0,
                 "buffer_max_staleness", self.buffer_max_staleness, "null or an int >= 0")
        _positive(self, "partial_every_s")
        _require(self.buffer_sampler in ("fifo", "newest", "uniform") or ":" in self.buffer_sampler,
                 "buffer_sampler", self.buffer_sampler,
                 "fifo, newest, uniform or 'package.module:Factory'")
        _require(self.buffer_when_full in ("block", "drop_oldest", "drop_stalest")
                 or ":" in self.buffer_when_full, "buffer_when_full", self.buffer_when_full,
                 "block, drop_oldest, drop_stalest or 'package.module:Factory'")


_REWARD_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?$")


@dataclass(frozen=True)
class RewardConfig:
    """Reward function: a built-in name or "package.module:function" (laminar_jax.rewards).

    Built-ins: exact_match, math (final answer, Math-Verify or sympy per math_backend), format
    (each of format_tags present once, in order), task (a built-in task's own rule), code_exec
    (the completion's last ```python block run in a sandbox against the row's answer_field
    tests). A user function is called as fn(prompt, completion, row) -> float with the dataset row.

    Rewards run in `workers` processes per rollout, off the decode loop: a call gets timeout_s
    of wall time, cpu_s of CPU and memory_mb of address space, else it is a "timeout" /
    "crashed" / "raised" failure (scored 0, counted, its first traceback printed). workers null
    (the default): 0 for the built-ins that are linear string rules (exact_match, format, task:
    `rewards.registry.IN_PROCESS_BUILTINS`), 2 for the rest (math, code_exec, a user function).
    0: scored on the rollout's own thread, no process and no limits (a raise is still counted;
    the rest of the failures cannot be caught there, so user code belongs in processes). The run stops
    when more than max_error_rate of the rollouts' last error_window completions failed.
    code_timeout_s / code_memory_mb: the sandbox of code_exec (per test case run).
    """

    fn: str = "task"
    format_tags: tuple[str, ...] = ("think",)
    math_backend: Literal["auto", "math_verify", "sympy"] = "auto"
    workers: int | None = None
    timeout_s: float = 10.0
    cpu_s: float = 10.0
    memory_mb: int = 4096
    max_error_rate: float = 0.5
    error_window: int = 64
    code_timeout_s: float = 5.0
    code_memory_mb: int = 512

    def __post_init__(self):
        _require(bool(_REWARD_RE.match(self.fn)) and (":" in self.fn or "." not in self.fn),
                 "fn", self.fn, "a built-in name or 'package.module:function'")
        _require(len(self.format_tags) > 0 and all(re.match(r"^[A-Za-z_][\w\-]*$", t)
                                                   for t in self.format_tags),
                 "format_tags", self.format_tags, "a non-empty list of tag names like think")
        _require(self.workers is None or self.workers >= 0, "workers", self.workers, "null or an int >= 0")
        _at_least(self, 1, "error_window")
        _at_least(self, 64, "memory_mb")
        _at_least(self, 16, "code_memory_mb")
        _positive(self, "timeout_s", "cpu_s", "code_timeout_s")
        _require(0 <= self.max_error_rate <= 1, "max_error_rate", self.max_error_rate, "a rate in [0, 1]")


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn environment (laminar_jax.env): null name = single-turn completions.

    name: a built-in environment (lookup, python) or "package.module:Factory", called as
    Factory(env_config) -> an object with reset(row) -> messages and step(text) -> (observation,
    reward, done, info). With an environment, a trajectory's reward is the sum of its step
    rewards (reward.fn is not called) and tool outputs enter the response with loss mask 0.
    max_turns: policy turns per trajectory; max_tool_calls: tool calls per trajectory (a turn
    past it ends the trajectory); max_total_tokens: response tokens (policy + tool) per
    trajectory; each turn also stops at rollout.max_new_tokens. tool_timeout_s: wall time of
    one tool call (the sandbox kills it); step_timeout_s: wall time of one env.step, after which
    the trajectory is dropped from the loss and counted; workers: threads per rollout running
    env steps off the decode loop. kv_policy: what a trajectory's K/V cache does while its tool
    runs: "keep" (the JAX engine keeps its pages and the continuation prefills only the tool's
    output; vLLM runs with prefix caching; kept pages are the first given back under KV pressure)
    or "release" (pages freed at once; the continuation re-prefills prompt + response so far).
    """

    name: str | None = None
    max_turns: int = 4
    max_tool_calls: int = 4
    max_total_tokens: int = 192
    tool_timeout_s: float = 5.0
    step_timeout_s: float = 30.0
    workers: int = 4
    kv_policy: Literal["keep", "release"] = "keep"

    def __post_init__(self):
        _require(self.kv_policy in ("keep", "release"), "kv_policy", self.kv_policy, "'keep' or 'release'")
        _require(self.name is None or (bool(_REWARD_RE.match(self.name)) and (":" in self.name or "." not in self.name)),
                 "name", self.name, "null, a built-in environment name or 'package.module:Factory'")
        _at_least(self, 1, "max_turns", "max_total_tokens", "workers")
        _at_least(self, 0, "max_tool_calls")
        _positive(self, "tool_timeout_s", "step_timeout_s")


@dataclass(frozen=True)
class Config:
    """Everything a run needs; `laminar config show CONFIG` prints it resolved."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    manager: ManagerConfig = field(default_factory=ManagerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    # The run anchors PPO on the engine's log-probs (bypass): with one update per version a trainer
    # recompute makes the clip a no-op, while the behaviour anchor keeps a trust region around the
    # policy that generated each (possibly stale) sample. LossSpec() itself keeps the textbook "prox".
    loss: LossSpec = field(default_factory=lambda: LossSpec(correction=CorrectionSpec(old="behaviour")))
    advantage: AdvantageSpec = field(default_factory=AdvantageSpec)

    def __post_init__(self):
        frac = self.learner.memory_fraction
        for i, pool in enumerate(self.rollout.pools_resolved()):
            # a fractional-GPU vLLM rollout may share the learner's GPU: their memory must fit in it
            share, a = vllm_memory_share(pool), pool.accelerators_per_rollout or 0.0
            if frac is None or pool.engine != "vllm" or not 0 < a < 1 or share is None:
                continue
            key = "rollout" if not self.rollout.pools else f"rollout.pools[{i}]"
            what = (f"{key}.gpu_memory_utilization={share:g}" if pool.gpu_memory_utilization is not None
                    else f"{key}.accelerators_per_rollout={a:g}")
            _require(frac + share <= 1 + 1e-9, "learner.memory_fraction", frac,
                     f"a fraction that leaves room for {what} of the vLLM rollout sharing its GPU "
                     f"(their sum {frac + share:g} > 1)")
        opt = self.optimizer
        _require(opt.schedule == "constant" or opt.warmup_steps < self.run.steps,
                 "optimizer.warmup_steps", opt.warmup_steps,
                 f"fewer than run.steps ({self.run.steps}) with schedule {opt.schedule!r}")
        _require(self.reward.fn != "task" or self.data.path is None, "reward.fn", self.reward.fn,
                 f"a reward for the rows of data.path={self.data.path!r} (exact_match, math, format or "
                 f"'package.module:function'); 'task' scores only the built-in tasks' rows")
        _require(self.env.name is None or self.env.max_total_tokens < self.learner.max_seq_len,
                 "env.max_total_tokens", self.env.max_total_tokens,
                 f"fewer than learner.max_seq_len ({self.learner.max_seq_len}): the prompt needs room too")
        if self.rollout.zero_mismatch:
            self._check_zero_mismatch()
        if self.run.colocate:
            self._check_colocate()

    def _check_colocate(self):
        """run.colocate: one process holds the learner and one JAX rollout, without Ray."""
        pools = [(p.name, p.engine, p.num_rollouts) for p in self.rollout.pools_resolved()]
        one = self.rollout.assignments()
        _require(len(one) == 1 and one[0][1].engine == "jax", "run.colocate", True,
                 f"exactly one rollout with engine jax (got pools {pools}); set rollout.num_rollouts=1 and "
                 f"rollout.engine=jax, or run.colocate=false")
        _require(self.run.ray_address is None, "run.colocate", True,
                 f"no run.ray_address (got {self.run.ray_address!r}): a colocated run uses no Ray cluster")
        m = self.mesh
        devices = max(1, m.data) * m.fsdp * m.tensor
        _require(self.learner.hosts == 1 and devices == 1, "run.colocate", True,
                 f"a learner of one host on one device (got learner.hosts={self.learner.hosts}, a mesh of "
                 f"{devices} devices): the rollout shares its process")
        _require(self.learner.memory_fraction is None, "run.colocate", True,
                 f"learner.memory_fraction null (got {self.learner.memory_fraction}): learner and rollout share "
                 f"one JAX client, whose memory settings are the process's")

    def _check_zero_mismatch(self):
        """rollout.zero_mismatch needs both sides to run the same batch-invariant JAX code."""
        r, m = self.rollout, self.model
        vllm = [p.name for p in r.pools_resolved() if p.engine != "jax"]
        _require(not vllm, "rollout.zero_mismatch", True,
                 f"engine jax in every pool (pools {vllm} use vllm, whose kernels cannot match the "
                 f"learner bit for bit); set rollout.zero_mismatch=false or rollout.engine=jax")
        _require(r.temperature == 1.0 and r.top_p == 1.0 and r.top_k == 0, "rollout.zero_mismatch", True,
                 f"rollout.temperature=1, top_p=1, top_k=0 (got {r.temperature}, {r.top_p}, {r.top_k}): "
                 f"the learner scores the untempered, untruncated distribution")
        _require(m.rollout_dtype == m.dtype, "rollout.zero_mismatch", True,
                 f"model.rollout_dtype == model.dtype (got {m.rollout_dtype!r} vs {m.dtype!r}): the "
                 f"engine must compute in the learner's dtype")
        _require(m.attention in ("auto", "exact"), "rollout.zero_mismatch", True,
                 f"model.attention auto or exact (got {m.attention!r}): zero mismatch runs the exact "
                 f"batch-invariant attention on both sides")
