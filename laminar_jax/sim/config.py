"""Schema of a simulator config (`configs/sim/*.yaml`), read by `laminar_jax.config_loader`.

A config holds the physical models of one setup (decode latency, KV capacity, prefill, trainer,
weight transfer, response lengths, tool latency), the systems to compare (scheduling mode plus
repack / relay toggles) and the cells to simulate (system x placement, each optionally with the
paper's measured throughput). Every section checks its ranges in `__post_init__` and raises
ValueError naming the field, the value and what was expected.

No jax import; pure python.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, field
from typing import Iterable, Literal

from laminar_jax.config_loader import check_at_least as _ints
from laminar_jax.config_loader import check_non_negative as _nonneg
from laminar_jax.config_loader import check_positive as _pos
from laminar_jax.config_loader import require as _require
from laminar_jax.manager.modes import MODE_RULES, Mode

__all__ = [
    "load_sim_config", "DecodeProfile", "TrainerModel", "WeightsModel", "ModelSpec", "LengthDist", "ToolSpec",
    "WorkloadSpec", "ClusterSpec", "RepackSpec", "SystemSpec", "CellSpec", "FailureSpec", "DataSpec",
    "RunSpec", "SimConfig",
]


@dataclass(frozen=True)
class DecodeProfile:
    """Decode step latency of one rollout replica at one tensor-parallel degree.

    `batch` / `latency_ms` is the measured curve at context `context_ref` (the paper's Fig 4:
    H800, sequence length 4096). Between points it is interpolated linearly, beyond the last
    point extrapolated with the last segment's slope. A fraction `kv_share` of the growth over
    the batch-1 latency comes from reading the KV cache and scales with the batch's context
    tokens K; the rest scales with the batch size n:

        mem(n, K) = L(1) + (L(n) - L(1)) * ((1 - kv_share) + kv_share * K / (n * context_ref))

    and the step takes max(mem(n, K), n * compute_s_per_token): large batches of short
    sequences become compute-bound (roofline). compute_s_per_token 0 disables the floor.
    kv_capacity_tokens: KV-cache size in tokens (where the paper's curves stop).
    prefill_tokens_per_s: prompt / re-prefill throughput (compute-bound).
    """

    tp: int
    batch: tuple[int, ...]
    latency_ms: tuple[float, ...]
    kv_capacity_tokens: int
    prefill_tokens_per_s: float
    context_ref: int = 4096
    kv_share: float = 0.8
    compute_s_per_token: float = 0.0

    def __post_init__(self):
        _ints(self, 1, "tp", "kv_capacity_tokens", "context_ref")
        _pos(self, "prefill_tokens_per_s")
        _nonneg(self, "compute_s_per_token")
        _require(0.0 <= self.kv_share <= 1.0, "kv_share", self.kv_share, "0 <= kv_share <= 1")
        _require(len(self.batch) >= 2 and len(self.batch) == len(self.latency_ms), "batch",
                 self.batch, f"at least 2 points, as many as latency_ms ({len(self.latency_ms)})")
        _require(self.batch[0] == 1, "batch", self.batch, "a curve starting at batch 1")
        _require(all(a < b for a, b in zip(self.batch, self.batch[1:])), "batch", self.batch,
                 "strictly increasing batch sizes")
        _require(all(x > 0 and math.isfinite(x) for x in self.latency_ms), "latency_ms",
                 self.latency_ms, "finite latencies > 0")
        _require(all(a <= b for a, b in zip(self.latency_ms, self.latency_ms[1:])),
                 "latency_ms", self.latency_ms, "latencies non-decreasing in batch size")


@dataclass(frozen=True)
class TrainerModel:
    """Learner time per global batch.

    One mini-batch is split over `train_accelerators // sp` data-parallel groups (sp =
    sequence-parallel size, one sequence never spans groups), balanced by longest-first
    assignment; its time is the busiest group's tokens * seconds_per_token / sp plus
    `minibatch_overhead_s` (optimizer step, gradient sync). seconds_per_token covers every
    learner pass per token (log-prob recompute, forward and backward). An update adds
    `step_overhead_s`.
    """

    seconds_per_token: float
    sp: int = 1
    minibatch_overhead_s: float = 0.0
    step_overhead_s: float = 0.0

    def __post_init__(self):
        _nonneg(self, "seconds_per_token", "minibatch_overhead_s", "step_overhead_s")
        _ints(self, 1, "sp")


@dataclass(frozen=True)
class WeightsModel:
    """Weight movement: relay publish / chain / pull, and the NCCL-style global sync.

    bytes: model size in the rollout dtype. publish_stall_s: learner stall to hand a version to
    the master relay [P §8.3]. t_byte_s / t_start_s: relay-chain link time per byte and per
    message (chain time model, App. D). pcie_bytes_per_s: relay-to-accelerator load bandwidth
    per accelerator (a rollout of tp accelerators pulls bytes / (tp * pcie) seconds).
    global_sync_s: a GPU global sync at `global_sync_ref_accelerators` rollout accelerators,
    growing by global_sync_per_doubling_s per doubling [P Fig 14]; both sides stall.
    storage_write_bytes_per_s / storage_read_bytes_per_s: weight transfer through shared
    storage (SystemSpec.weight_transfer "storage"): the learner stalls while it writes the
    version, each rollout stalls while it reads it [P §4.1].
    """

    bytes: float
    publish_stall_s: float = 0.0
    t_byte_s: float = 0.0
    t_start_s: float = 0.0
    pcie_bytes_per_s: float = 30e9
    global_sync_s: float = 0.0
    global_sync_per_doubling_s: float = 0.0
    global_sync_ref_accelerators: int = 32
    storage_write_bytes_per_s: float = 1e9
    storage_read_bytes_per_s: float = 4e9

    def __post_init__(self):
        _pos(self, "bytes", "pcie_bytes_per_s", "storage_write_bytes_per_s",
             "storage_read_bytes_per_s")
        _nonneg(self, "publish_stall_s", "t_byte_s", "t_start_s", "global_sync_s",
                "global_sync_per_doubling_s")
        _ints(self, 1, "global_sync_ref_accelerators")


@dataclass(frozen=True)
class ModelSpec:
    """One model size: decode profiles per tensor-parallel degree, trainer and weight models.

    RL generation is slower than the decode micro-benchmark of Fig 4 (sampling with log-probs,
    scheduling, streaming partial tokens to the pool): a step takes
    decode_overhead * step_fig4(n, K) + decode_step_overhead_s.
    """

    name: str
    decode: tuple[DecodeProfile, ...]
    trainer: TrainerModel
    weights: WeightsModel
    decode_overhead: float = 1.0
    decode_step_overhead_s: float = 0.0

    def __post_init__(self):
        _nonneg(self, "decode_step_overhead_s")
        _require(bool(self.name.strip()), "name", self.name, "a non-empty string")
        _require(math.isfinite(self.decode_overhead) and self.decode_overhead >= 1.0,
                 "decode_overhead", self.decode_overhead, "a finite number >= 1")
        tps = [d.tp for d in self.decode]
        _require(len(tps) >= 1 and len(set(tps)) == len(tps), "decode", tps,
                 "at least one profile, one per tp")

    def profile(self, tp: int) -> DecodeProfile:
        for d in self.decode:
            if d.tp == tp:
                return d
        raise ValueError(f"model.decode: no profile for tp={tp} (have {[d.tp for d in self.decode]})")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, clipped to [minimum, maximum].

    kind "lognormal": median, sigma (log-space; a share `group_share` of the log-variance is
    common to a prompt group, so hard prompts give long groups). "mixture": lognormal
    components with `medians`, `sigmas`, `weights` (same group_share rule). "histogram":
    `edges` (n+1 bin edges) and `weights` (n bins), uniform within a bin, one bin draw per
    trajectory (no group correlation). "fixed": always `median`.
    """

    kind: Literal["lognormal", "mixture", "histogram", "fixed"] = "lognormal"
    median: float = 1000.0
    sigma: float = 1.0
    medians: tuple[float, ...] = ()
    sigmas: tuple[float, ...] = ()
    weights: tuple[float, ...] = ()
    edges: tuple[float, ...] = ()
    group_share: float = 0.0
    minimum: int = 1
    maximum: int = 16384

    def __post_init__(self):
        _pos(self, "median")
        _nonneg(self, "sigma")
        _ints(self, 1, "minimum")
        _require(self.maximum >= self.minimum, "maximum", self.maximum,
                 f"an int >= minimum ({self.minimum})")
        _require(0.0 <= self.group_share <= 1.0, "group_share", self.group_share, "in [0, 1]")
        if self.kind == "mixture":
            n = len(self.medians)
            _require(n >= 1 and len(self.sigmas) == n and len(self.weights) == n, "medians",
                     self.medians, "as many medians, sigmas and weights (>= 1)")
            _require(all(m > 0 for m in self.medians), "medians", self.medians, "values > 0")
            _require(all(s >= 0 for s in self.sigmas), "sigmas", self.sigmas, "values >= 0")
        if self.kind == "histogram":
            _require(len(self.edges) >= 2 and len(self.weights) == len(self.edges) - 1, "edges",
                     self.edges, "n+1 increasing edges for n weights")
            _require(all(a < b for a, b in zip(self.edges, self.edges[1:])), "edges",
                     self.edges, "strictly increasing edges")
        if self.kind in ("mixture", "histogram"):
            _require(all(w >= 0 for w in self.weights) and sum(self.weights) > 0, "weights",
                     self.weights, "non-negative weights with a positive sum")


@dataclass(frozen=True)
class ToolSpec:
    """Multi-turn tool calls: up to max_calls per trajectory, each after a generated segment.

    Calls per trajectory: uniform on [0, max_calls], or `calls_weights` (P(k calls) for k = 0 ..
    max_calls, normalised). The response is cut into calls+1 segments of random share. Each call
    waits an environment latency with the trajectory's KV cache freed, then appends
    `output_tokens` of tool output, which are re-prefilled with the whole context. Latency
    (`latency_kind`): "lognormal" (median latency_median_s, log-sd latency_sigma), "exponential"
    (median latency_median_s), "fixed" (latency_median_s); clipped at latency_max_s.
    Failed calls: with probability failure_prob a call hangs and is killed at timeout_s (its
    wait is timeout_s; its error message is output_tokens long as well).
    Sandbox concurrency: at most sandbox_slots calls run at once in the whole cluster (0 = no
    limit); the others queue first come, first served, and their wait adds to the latency.
    """

    max_calls: int = 0
    latency_median_s: float = 5.0
    latency_sigma: float = 1.0
    latency_max_s: float = 600.0
    output_tokens: int = 200
    latency_kind: Literal["lognormal", "exponential", "fixed"] = "lognormal"
    calls_weights: tuple[float, ...] = ()
    failure_prob: float = 0.0
    timeout_s: float = 30.0
    sandbox_slots: int = 0

    def __post_init__(self):
        _ints(self, 0, "max_calls", "output_tokens", "sandbox_slots")
        _pos(self, "latency_median_s", "latency_max_s", "timeout_s")
        _nonneg(self, "latency_sigma")
        _require(self.latency_kind in ("lognormal", "exponential", "fixed"), "latency_kind", self.latency_kind,
                 "lognormal, exponential or fixed")
        _require(0.0 <= self.failure_prob <= 1.0, "failure_prob", self.failure_prob, "in [0, 1]")
        _require(not self.calls_weights or (len(self.calls_weights) == self.max_calls + 1
                                            and all(w >= 0 for w in self.calls_weights)
                                            and sum(self.calls_weights) > 0), "calls_weights", self.calls_weights,
                 f"max_calls + 1 = {self.max_calls + 1} non-negative weights (P(0 calls) .. P(max_calls)) "
                 f"with a positive sum, or empty (uniform)")


@dataclass(frozen=True)
class WorkloadSpec:
    """Prompts and responses: GRPO group size, prompt and response lengths, tool calls."""

    group_size: int = 16
    prompt: LengthDist = field(default_factory=lambda: LengthDist(median=200.0, sigma=0.4,
                                                                  maximum=2048))
    response: LengthDist = field(default_factory=LengthDist)
    tools: ToolSpec = field(default_factory=ToolSpec)

    def __post_init__(self):
        _ints(self, 1, "group_size")


@dataclass(frozen=True)
class ClusterSpec:
    """Machines: accelerators per machine (one relay per rollout machine); KV admission reserve.

    kv_reserve_tokens: a waiting request is admitted only if every running sequence keeps this
    much KV headroom afterwards (vLLM-like admission; the rest is handled by preemption).
    colocate_switch_s: per switch between generation and training in a colocated placement.
    """

    accelerators_per_machine: int = 8
    kv_reserve_tokens: int = 64
    colocate_switch_s: float = 0.0

    def __post_init__(self):
        _ints(self, 1, "accelerators_per_machine")
        _ints(self, 0, "kv_reserve_tokens")
        _nonneg(self, "colocate_switch_s")


@dataclass(frozen=True)
class RepackSpec:
    """Dynamic repack [P §5]: check every interval_s and after each publish.

    c_max and roofline_batch go to `laminar_jax.manager.repack.plan`. overhead_s: delay before
    moved trajectories reach their destination (the paper measures 0.69 s).
    transfer: what a move carries. "recompute": token ids only, the destination re-prefills
    each moved trajectory's context (stalling its decode for context / prefill rate). "kv": the
    KV cache moves with the trajectories within overhead_s and decode resumes without a
    prefill. Either way a trajectory stays on its weight version.
    """

    interval_s: float = 5.0
    c_max: float = 0.99
    roofline_batch: int = 64
    overhead_s: float = 0.69
    transfer: Literal["recompute", "kv"] = "recompute"

    def __post_init__(self):
        _pos(self, "interval_s")
        _require(0 < self.c_max <= 1, "c_max", self.c_max, "0 < c_max <= 1")
        _ints(self, 1, "roofline_batch")
        _nonneg(self, "overhead_s")


@dataclass(frozen=True)
class DataSpec:
    """The experience buffer, with the runtime's keys and semantics (`laminar_jax.config.DataConfig`,
    `laminar_jax.sim.buffer`).

    buffer_groups: groups the buffer holds (None = one global batch, global_batch /
    group_size). buffer_when_full: "block" (back-pressure: a rollout keeps a refused group and
    takes no new prompts until it is delivered), "drop_oldest", "drop_stalest" (smallest
    gen_version) or an import path "pkg.module:Factory", as in the runtime.
    """

    buffer_groups: int | None = None
    buffer_when_full: str = "block"

    def __post_init__(self):
        _require(self.buffer_groups is None or (isinstance(self.buffer_groups, int)
                                                and self.buffer_groups >= 1),
                 "buffer_groups", self.buffer_groups, "null or an int >= 1")
        _require(self.buffer_when_full in ("block", "drop_oldest", "drop_stalest")
                 or ":" in self.buffer_when_full, "buffer_when_full", self.buffer_when_full,
                 "block, drop_oldest, drop_stalest or 'package.module:Factory'")


@dataclass(frozen=True)
class SystemSpec:
    """A system to simulate: scheduling mode, rollout TP and engine limits, toggles.

    max_num_seqs: engine cap on running sequences. max_concurrency: per-rollout batch
    (laminar) or in-flight cap (partial). colocated: learner and rollouts time-share all
    accelerators (verl). relays: laminar's relay tier (False = global sync barrier).
    max_staleness: bound for stream / partial (None = unbounded); laminar (staleness observed,
    None = ungated, the paper's): the bound of its issue gate and buffer staleness filter
    (`modes.issue_bound`, `modes.bounded_issue_limit`), as for partial's eta.
    weight_transfer: how a partial-rollout system moves a version: "nccl" (global GPU sync,
    both sides stall) or "storage" (the learner writes it to shared storage, then every rollout
    is interrupted and reads it).
    trainer: a learner model of this system's own training stack, replacing model.trainer
    (e.g. AReaL trains with Megatron-LM, the others with FSDP).
    """

    name: str
    mode: Mode                      # the modes of manager.modes.MODE_RULES
    rollout_tp: int = 1
    colocated: bool = False
    max_num_seqs: int = 1024
    max_concurrency: int = 1024
    repack: bool = False
    relays: bool = False
    max_staleness: int | None = None
    weight_transfer: Literal["nccl", "storage"] = "nccl"
    trainer: TrainerModel | None = None

    def __post_init__(self):
        _require(bool(self.name.strip()), "name", self.name, "a non-empty string")
        _require(self.mode in MODE_RULES, "mode", self.mode, f"one of {tuple(MODE_RULES)}")
        rules = MODE_RULES[self.mode]
        _require(self.weight_transfer == "nccl" or rules.interrupts_on_publish, "weight_transfer",
                 self.weight_transfer, "'nccl' unless the mode interrupts on publish (partial)")
        _ints(self, 1, "rollout_tp", "max_num_seqs", "max_concurrency")
        _require(not self.colocated or (rules.global_batches and rules.bound() == 0),
                 "colocated", self.colocated,
                 "false unless the mode has global batches of staleness 0 (sync)")
        _require(not self.repack or rules.may_repack, "repack", self.repack,
                 "false unless the mode may repack (laminar)")
        _require(self.max_staleness is None or self.max_staleness >= 0, "max_staleness",
                 self.max_staleness, "None or an int >= 0")


@dataclass(frozen=True)
class CellSpec:
    """One simulation: `system` on `accelerators` (train + rollout split), and the paper's value.

    For a colocated system set train = rollout = accelerators.
    """

    system: str
    accelerators: int
    train: int
    rollout: int
    paper_tokens_per_s: float | None = None

    def __post_init__(self):
        _ints(self, 1, "accelerators", "train", "rollout")
        _require(self.paper_tokens_per_s is None or self.paper_tokens_per_s > 0,
                 "paper_tokens_per_s", self.paper_tokens_per_s, "None or a number > 0")


@dataclass(frozen=True)
class FailureSpec:
    """A rollout machine dies at time_s and is replaced, ready, recovery_s later [P §8.5]."""

    time_s: float
    machine: int = 0
    recovery_s: float = 252.0

    def __post_init__(self):
        _nonneg(self, "time_s", "recovery_s")
        _ints(self, 0, "machine")


@dataclass(frozen=True)
class RunSpec:
    """How long to run and what to write.

    Throughput is averaged over `measure_steps` learner updates after `warmup_steps`
    [P §8: 5 after 10]. Reaching max_trajectories (generated) or max_time_s (simulated) first
    is an error naming the cap and the cell (`engine.CapReached`), never a NaN throughput.
    write: what each cell leaves under out_dir: "full" (metrics, every consumed trajectory,
    every event), "summary" (metrics.parquet and the summary event), "none"; true / false
    mean full / none.
    only_systems / only_accelerators pick a subset of the cells (empty = all).
    """

    global_batch: int = 8192
    mini_batch: int = 512
    warmup_steps: int = 10
    measure_steps: int = 5
    max_trajectories: int = 2_000_000
    max_time_s: float = 1e7
    sample_interval_s: float = 10.0
    out_dir: str = "runs/sim"
    write: bool | Literal["none", "summary", "full"] = "full"
    only_systems: tuple[str, ...] = ()
    only_accelerators: tuple[int, ...] = ()

    def __post_init__(self):
        _ints(self, 1, "global_batch", "mini_batch", "measure_steps", "max_trajectories")
        _ints(self, 0, "warmup_steps")
        _require(self.global_batch % self.mini_batch == 0, "mini_batch", self.mini_batch,
                 f"a divisor of global_batch ({self.global_batch})")
        _pos(self, "max_time_s", "sample_interval_s")
        if isinstance(self.write, bool):
            object.__setattr__(self, "write", "full" if self.write else "none")
        _require(self.write in ("none", "summary", "full"), "write", self.write,
                 "none, summary or full (or true / false)")


@dataclass(frozen=True)
class SimConfig:
    """A simulator scenario: models, workload, systems and cells."""

    model: ModelSpec
    systems: tuple[SystemSpec, ...]
    cells: tuple[CellSpec, ...]
    name: str = "sim"
    seed: int = 0
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    repack: RepackSpec = field(default_factory=RepackSpec)
    data: DataSpec = field(default_factory=DataSpec)
    run: RunSpec = field(default_factory=RunSpec)
    failures: tuple[FailureSpec, ...] = ()
    tolerance: float = 0.25

    def __post_init__(self):
        _require(bool(self.name.strip()) and "/" not in self.name, "name", self.name,
                 "a folder name without '/'")
        _ints(self, 0, "seed")
        _pos(self, "tolerance")
        names = [s.name for s in self.systems]
        _require(len(names) >= 1 and len(set(names)) == len(names), "systems", names,
                 "at least one system, unique names")
        _require(len(self.cells) >= 1, "cells", self.cells, "at least one cell")
        need = self.run.global_batch // self.workload.group_size
        _require(self.data.buffer_groups is None or self.data.buffer_groups >= need,
                 "data.buffer_groups", self.data.buffer_groups,
                 f"null or at least one global batch ({self.run.global_batch} / group_size "
                 f"{self.workload.group_size} = {need} groups): the learner takes a whole batch")
        for i, c in enumerate(self.cells):
            _require(c.system in names, "cells", f"cells[{i}].system={c.system!r}",
                     f"a system name from {names}")
            system = self.systems[names.index(c.system)]
            self.model.profile(system.rollout_tp)
            _require(c.rollout % system.rollout_tp == 0, "cells",
                     f"cells[{i}].rollout={c.rollout}", f"a multiple of rollout_tp "
                     f"({system.rollout_tp}) of {c.system!r}")
            if system.colocated:
                _require(c.train == c.rollout == c.accelerators, "cells", f"cells[{i}]",
                         "train == rollout == accelerators for a colocated system")
            else:
                _require(c.train + c.rollout == c.accelerators, "cells", f"cells[{i}]",
                         "train + rollout == accelerators")
            rules = MODE_RULES[system.mode]
            if rules.global_batches:
                _require(self.data.buffer_when_full == "block", "data.buffer_when_full",
                         f"{self.data.buffer_when_full!r} with {c.system!r}",
                         "block for a global-batch mode (a global batch cannot lose groups)")
            sp = (system.trainer or self.model.trainer).sp
            _require(c.train >= sp, "cells", f"cells[{i}].train={c.train}",
                     f"at least the trainer's sp ({sp}) accelerators")

    def system(self, name: str) -> SystemSpec:
        for s in self.systems:
            if s.name == name:
                return s
        raise ValueError(f"systems: no system named {name!r}")

    def buffer_capacity(self) -> int:
        """data.buffer_groups, or one global batch of groups when it is null."""
        if self.data.buffer_groups is not None:
            return self.data.buffer_groups
        return self.run.global_batch // self.workload.group_size

    def selected_cells(self) -> tuple[CellSpec, ...]:
        cells = self.cells
        if self.run.only_systems:
            cells = tuple(c for c in cells if c.system in self.run.only_systems)
        if self.run.only_accelerators:
            cells = tuple(c for c in cells if c.accelerators in self.run.only_accelerators)
        return cells


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_sim_config(path, overrides: Iterable[str] = ()) -> SimConfig:
    """Load a simulator scenario; a top-level `base: other.yaml` (relative to the file) is
    loaded first and this file's keys are merged over it (mappings merge, lists replace), so
    a study restates only what it changes. Then the dotted overrides apply."""
    from laminar_jax.config_loader import ConfigError, config_from_dict, yaml_load

    path = pathlib.Path(path)
    seen: list[pathlib.Path] = []

    def read(p: pathlib.Path) -> dict:
        if p.resolve() in seen:
            raise ConfigError(f"{path}: base: files include each other ({p})")
        seen.append(p.resolve())
        try:
            data = yaml_load(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{p}: no such config file") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level")
        base = data.pop("base", None)
        if base is None:
            return data
        if not isinstance(base, str):
            raise ConfigError(f"{p}: base: expected a file name, got {base!r}")
        return _merge(read(p.parent / base), data)

    return config_from_dict(read(path), list(overrides), SimConfig, source=str(path))
