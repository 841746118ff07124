"""Results of simulated runs: run folders (same format as a real run) and the comparison table.

A simulated cell writes the folder `metrics.RunWriter` writes for a real run, so
`laminar_jax.analysis.load_run` reads both:
- metrics.parquet: one row per learner update: throughput (paper definition: prompt + response
  tokens of the batch over the time since the previous update), iteration time, staleness
  mean / max, rollout / learner / accelerator idle fractions, KV use and generation rate
  over the iteration, simulated time.
- trajectories.parquet: one row per consumed trajectory (lengths, gen_version, consuming
  learner version, staleness, rollout, repacks, preemptions, versions spanned, times).
- events.jsonl: publishes, pulls, repacks, global syncs, interrupts, failures, KV samples
  (kind "kv_sample"), and a final "summary" with the staleness histogram. Simulated times
  are in the `sim_time` field (the writer's `time` is the wall clock).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import pathlib
import shutil

import numpy as np

from laminar_jax.config_loader import dump_config
from laminar_jax.manager import modes

__all__ = ["CellResult", "cell_result", "write_run", "staleness_histogram", "render_table",
           "table_rows", "markdown_table", "speedups", "mean_ratio_error"]


@dataclasses.dataclass(frozen=True)
class CellResult:
    """Summary of one simulated cell."""

    system: str
    mode: str
    accelerators: int
    train: int
    rollout: int
    throughput: float
    paper: float | None
    iteration_s: float
    rollout_idle_frac: float
    learner_idle_frac: float
    accelerator_idle_frac: float
    kv_use: float
    gen_tokens_per_s: float
    staleness_mean: float
    staleness_max: int
    staleness_hist: dict
    steps: int
    trajectories: int
    sim_time_s: float
    steady: bool = True
    occupancy_drift: float = 0.0
    staleness_drift: float = 0.0
    buffer_groups_mean: float = 0.0
    held_groups_mean: float = 0.0
    evicted_groups: int = 0
    weight_wait_s: float = float("nan")
    run_dir: str | None = None

    @property
    def ratio(self) -> float:
        return self.throughput / self.paper if self.paper else float("nan")

    @property
    def reported(self) -> float:
        """The throughput to report: NaN for a cell without a steady state (`Sim.steady_state`),
        whose number would be a filling pipeline's, not the system's."""
        return self.throughput if self.steady else float("nan")


def consumed_arrays(sim) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(trajectory ids, consuming learner versions, consume times) of every consumed trajectory.

    Cached on the sim while nothing more was consumed (a report asks ~6 times per cell);
    callers must not modify the arrays."""
    cached = getattr(sim, "_consumed_arrays", None)
    if cached is not None and cached[0].size == len(sim.consumed_ids):
        return cached
    out = (np.asarray(sim.consumed_ids, np.int64), np.asarray(sim.consumed_versions, np.int64),
           np.asarray(sim.consumed_times, np.float64))
    sim._consumed_arrays = out
    return out


def staleness_of(sim, ids: np.ndarray, versions: np.ndarray) -> np.ndarray:
    """learner version at consumption - gen_version, vectorised `modes.staleness` (same check:
    a trajectory from weights newer than its consumer is a bookkeeping bug)."""
    stale = versions - np.asarray(sim.ts.gen_version, np.int64)[ids]
    if stale.size and stale.min() < 0:
        bad = int(np.argmin(stale))
        modes.staleness(int(versions[bad]), int(sim.ts.gen_version[ids[bad]]))   # raises
    return stale


def staleness_histogram(sim, *, measured_only: bool = True) -> dict[int, int]:
    """Consumed trajectories per staleness value (learner version at consumption - gen_version)."""
    first = 0
    if measured_only and sim.cfg.run.warmup_steps and len(sim.steps) > sim.cfg.run.warmup_steps:
        first = sum(s["trajectories"] for s in sim.steps[: sim.cfg.run.warmup_steps])
    ids, versions, _ = consumed_arrays(sim)
    stale = staleness_of(sim, ids[first:], versions[first:])
    counts = np.bincount(stale) if stale.size else np.zeros(0, np.int64)
    return {int(k): int(c) for k, c in enumerate(counts) if c}


def cell_result(sim, run_dir: str | None = None) -> CellResult:
    s = sim.summary()
    c = sim.cell
    nan = float("nan")
    return CellResult(
        system=c.system, mode=sim.mode, accelerators=c.accelerators, train=c.train,
        rollout=c.rollout, throughput=s["throughput"], paper=c.paper_tokens_per_s,
        iteration_s=s.get("iteration_s", nan),
        rollout_idle_frac=s.get("rollout_idle_frac", nan),
        learner_idle_frac=s.get("learner_idle_frac", nan),
        accelerator_idle_frac=s.get("accelerator_idle_frac", nan),
        kv_use=s.get("kv_use", nan), gen_tokens_per_s=s.get("gen_tokens_per_s", nan),
        staleness_mean=s.get("staleness_mean", nan), staleness_max=s.get("staleness_max", 0),
        staleness_hist=staleness_histogram(sim), steps=len(sim.steps),
        trajectories=sim.issued, sim_time_s=sim.now, steady=bool(s.get("steady", False)),
        occupancy_drift=s.get("occupancy_drift", nan), staleness_drift=s.get("staleness_drift", nan),
        buffer_groups_mean=s.get("buffer_groups_mean", nan),
        held_groups_mean=s.get("held_groups_mean", nan),
        evicted_groups=s.get("evicted_groups", 0), weight_wait_s=s.get("weight_wait_s", nan),
        run_dir=run_dir)


def trajectory_columns(sim) -> dict[str, np.ndarray]:
    """trajectories.parquet as columns: one entry per consumed trajectory, built from the
    TrajStore lists with numpy gathers (no per-row dicts)."""
    ts = sim.ts
    ids, versions, times = consumed_arrays(sim)
    if not ids.size:
        gather = lambda values: ()                      # noqa: E731
    elif ids.size == 1:
        gather = lambda values: (values[int(ids[0])],)  # noqa: E731
    else:
        gather = operator.itemgetter(*sim.consumed_ids)   # one C call per column

    def col(values, dtype):
        return np.asarray(gather(values), dtype)

    tools = gather(ts.tools)
    calls = np.fromiter((0 if t is None else len(t[0]) for t in tools), np.int64,
                        count=len(tools))
    out_tokens = np.fromiter((0 if t is None else t[2] for t in tools), np.int64,
                             count=len(tools))
    start, finish = col(ts.start_t, np.float64), col(ts.finish_t, np.float64)
    return {
        "id": ids,
        "group": col(ts.group, np.int64),
        "prompt_len": col(ts.prompt, np.int64),
        "response_len": col(ts.resp, np.int64) + calls * out_tokens,
        "tool_calls": calls,
        "tool_failed": np.fromiter((0 if t is None else sum(t[3]) for t in tools), np.int64, count=len(tools)),
        "tool_wait_s": col(ts.tool_wait, np.float64),
        "gen_version": col(ts.gen_version, np.int64),
        "learner_version": versions,
        "staleness": staleness_of(sim, ids, versions),
        "rollout": col(ts.first_rollout, np.int64),
        "repacks": col(ts.repacks, np.int64),
        "preemptions": col(ts.preempts, np.int64),
        "versions": col(ts.versions, np.int64),
        "start_time": start,
        "finish_time": finish,
        "consume_time": times,
        "latency_s": finish - start,
    }


_RUN_FILES = ("metrics.parquet", "trajectories.parquet", "events.jsonl")   # and the part folders
_RUN_DIRS = ("metrics", "trajectories")


def write_run(sim, run_dir: str | pathlib.Path, *, tensorboard: bool = True,
              mode: str = "full") -> CellResult:
    """Write one simulated cell as a run folder; returns its summary.

    mode "full": metrics, every consumed trajectory, every event and KV sample. "summary":
    metrics, config and the final summary event only (no trajectories, no per-event lines). A folder left by an earlier simulation of the same cell is replaced
    (its files, not the folder), so re-running a scenario does not append to old rows.
    """
    from laminar_jax.metrics import RunWriter

    if mode not in ("summary", "full"):
        raise ValueError(f"run.write: expected summary or full, got {mode!r}")
    run_dir = pathlib.Path(run_dir)
    for name in _RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in _RUN_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    config = {"sim": dump_config(sim.cfg), "cell": dataclasses.asdict(sim.cell),
              "system": dataclasses.asdict(sim.system)}
    result = cell_result(sim, str(run_dir))
    with RunWriter(run_dir, config, flush_every=1 << 30, tensorboard=tensorboard) as w:
        for row in sim.steps:
            w.log_step(row["step"], {("sim_time" if k == "time" else k): v
                                     for k, v in row.items() if k != "step"})
        if mode == "full":
            w.log_trajectory_columns(trajectory_columns(sim))
            for ev in sim.events:
                fields = {("sim_time" if k == "time" else k): v for k, v in ev.items()
                          if k != "kind"}
                w.log_event(ev["kind"], **fields)
            for smp in sim.kv_samples:
                w.log_event("kv_sample", **{("sim_time" if k == "time" else k): v
                                            for k, v in smp.items()})
        summary = dataclasses.asdict(result)
        summary["staleness_hist"] = {str(k): v for k, v in result.staleness_hist.items()}
        w.log_event("summary", **summary)
    return result


def table_rows(results: list[CellResult]) -> tuple[list[int], dict[str, dict[int, CellResult]]]:
    """(sorted accelerator counts, {system: {accelerators: result}}) in first-seen order."""
    scales = sorted({r.accelerators for r in results})
    by_system: dict[str, dict[int, CellResult]] = {}
    for r in results:
        by_system.setdefault(r.system, {})[r.accelerators] = r
    return scales, by_system


def _fmt(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x / 1e5:.2f}"


def render_table(results: list[CellResult], *, title: str, tolerance: float):
    """A rich Table: simulated vs paper throughput (x1e5 tokens/s), one row per system; a cell
    without a steady state is marked unsteady (its number in brackets), not as a throughput."""
    from rich.table import Table

    scales, by_system = table_rows(results)
    table = Table(title=title, show_lines=False)
    table.add_column("system")
    for n in scales:
        table.add_column(f"{n} acc.\nsim / paper", justify="right")
    for system, cells in by_system.items():
        row = [system]
        for n in scales:
            r = cells.get(n)
            if r is None:
                row.append("")
                continue
            text = _fmt(r.throughput)
            if not r.steady:
                text = f"[red]unsteady[/red] ({text})"
                if r.paper:
                    text += f" / {_fmt(r.paper)}"
            elif r.paper:
                ok = abs(r.ratio - 1.0) <= tolerance
                colour = "green" if ok else "red"
                text = f"{text} / {_fmt(r.paper)} [{colour}]({r.ratio:.2f})[/{colour}]"
            row.append(text)
        table.add_row(*row)
    return table


def speedups(results: list[CellResult], *, over: str, of: str = "laminar") -> dict[int, tuple]:
    """{accelerators: (simulated speedup, paper speedup)} of system `of` over system `over`."""
    _, by_system = table_rows(results)
    out = {}
    a, b = by_system.get(of, {}), by_system.get(over, {})
    for n in sorted(set(a) & set(b)):
        sim = a[n].throughput / b[n].throughput
        paper = (a[n].paper / b[n].paper) if a[n].paper and b[n].paper else float("nan")
        out[n] = (sim, paper)
    return out


def mean_ratio_error(results: list[CellResult]) -> float:
    vals = [abs(r.ratio - 1.0) for r in results if r.paper]
    return float(np.mean(vals)) if vals else float("nan")


def markdown_table(results: list[CellResult], *, tolerance: float) -> str:
    """The comparison as a Markdown table: `sim / paper (ratio)` in 1e5 tokens/s per cell;
    a ratio outside 1 +- tolerance is marked with **bold**; a cell without a steady state
    reads `unsteady (number)`, never a plain throughput."""
    scales, by_system = table_rows(results)
    lines = ["| system | " + " | ".join(f"{n}" for n in scales) + " |",
             "|---|" + "---|" * len(scales)]
    for system, cells in by_system.items():
        row = []
        for n in scales:
            r = cells.get(n)
            if r is None:
                row.append("")
            elif not r.steady:
                row.append(f"unsteady ({_fmt(r.throughput)})"
                           + (f" / {_fmt(r.paper)}" if r.paper else ""))
            elif r.paper:
                ratio = f"{r.ratio:.2f}"
                if abs(r.ratio - 1.0) > tolerance:
                    ratio = f"**{ratio}**"
                row.append(f"{_fmt(r.throughput)} / {_fmt(r.paper)} ({ratio})")
            else:
                row.append(_fmt(r.throughput))
        lines.append(f"| {system} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
