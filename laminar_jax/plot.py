"""`laminar plot RUN [RUN ...]`: the standard panels of run folders as PNGs (matplotlib).

    reward.png       mean reward and exact-answer rate against wall-clock
    throughput.png   consumed tokens/s (simulator: the paper's throughput) against wall-clock
    staleness.png    histogram of trajectory staleness (learner version - oldest token's version)
    kv.png           KV-cache use over time, per rollout where the run logged it
    repack.png       repack events on the timeline, over generation tokens/s
    idle.png         learner and rollout idle fractions over time

Several runs are drawn side by side (one column each, shared y axes), for real and simulated run
folders alike: a simulator folder has the same files, with `sim_time` as its clock and
`kv_sample` events for KV use; a panel a run has no data for says so. Figures are built without
pyplot (backend-free, safe in notebooks and headless CI). No jax import.
"""
from __future__ import annotations

import argparse
import pathlib
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from laminar_jax.analysis import Run, load_run

PANELS = ("reward", "throughput", "staleness", "kv", "repack", "idle")


def _clock(run: Run) -> tuple[pd.Series, pd.Series, str]:
    """(x of each metrics row, x of each event, axis label): simulated seconds for a simulator
    run, else seconds since the run's first event (unix `wall_time` of each step)."""
    m, e = run.metrics, run.events
    if "sim_time" in m:
        ev = e["sim_time"] if "sim_time" in e else pd.Series(np.nan, index=e.index)
        return m["sim_time"].astype(float), ev.astype(float), "simulated time (s)"
    if "wall_time" in m:
        t0 = min(float(e["time"].min()) if len(e) else np.inf, float(m["wall_time"].min()))
        return m["wall_time"] - t0, e["time"] - t0, "wall-clock (s)"
    if "step_wall_s" in m:  # older folders: no absolute time per step
        x = m["step_wall_s"].cumsum()
        t0 = float(e["time"].min()) if len(e) else 0.0
        return x, e["time"] - t0, "wall-clock (s, summed step times)"
    return m["step"].astype(float), pd.Series(np.nan, index=e.index), "learner step"


def _line(ax, x, y, **kw) -> None:
    """A line that breaks where the clock jumps (a crashed run and its resumption, minutes apart)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) > 2:
        dx = np.diff(x)
        gap = np.flatnonzero(dx > max(10.0, 5 * float(np.nanmedian(dx))))
        x, y = np.insert(x, gap + 1, np.nan), np.insert(y, gap + 1, np.nan)
    ax.plot(x, y, **kw)


def _none(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center", transform=ax.transAxes,
            color="gray")


def _reward(ax, run: Run) -> None:
    x, _, label = _clock(run)
    m = run.metrics
    if "reward_mean" not in m:
        return _none(ax, "reward")
    _line(ax, x, m["reward_mean"], marker=".", label="mean reward")
    if "exact_rate" in m:
        _line(ax, x, m["exact_rate"], marker=".", label="exact answers")
    ax.set(xlabel=label, ylabel="per learner step")
    ax.legend(loc="lower right", fontsize="small")


def _throughput(ax, run: Run) -> None:
    x, _, label = _clock(run)
    m = run.metrics
    col = next((c for c in ("tokens_per_s", "throughput") if c in m), None)
    if col is None:
        return _none(ax, "throughput")
    _line(ax, x, m[col], marker=".", label=f"consumed ({col})")
    if "gen_tokens_per_s" in m:
        _line(ax, x, m["gen_tokens_per_s"], marker=".", alpha=0.7, label="generated")
    ax.set(xlabel=label, ylabel="tokens / s")
    ax.legend(fontsize="small")


def _staleness(ax, run: Run) -> None:
    t = run.trajectories
    if "staleness" not in t or t.empty:
        return _none(ax, "trajectory staleness")
    s = t["staleness"].dropna().astype(int)
    counts = s.value_counts().sort_index()
    ax.bar(counts.index, counts.values / counts.values.sum())
    ax.set(xlabel="staleness (versions)", ylabel="fraction of trajectories",
           title=f"mean {s.mean():.2f}, max {s.max()}")


def _kv(ax, run: Run) -> None:
    x, xe, label = _clock(run)
    m, e = run.metrics, run.events
    per = sorted(c for c in m.columns if c.startswith("kv_use/"))
    if per:
        for c in per:
            _line(ax, x, m[c], marker=".", label=c.split("/", 1)[1])
    elif "kind" in e and (e["kind"] == "kv_sample").any():  # the simulator's samples
        s = e["kind"] == "kv_sample"
        ax.plot(xe[s], e.loc[s, "kv_use_mean"], label="mean")
        ax.fill_between(xe[s], e.loc[s, "kv_use_p10"], e.loc[s, "kv_use_p90"], alpha=0.3, label="p10-p90")
    elif "kv_use_mean" in m:
        _line(ax, x, m["kv_use_mean"], marker=".", label="mean over rollouts")
    elif "kv_use" in m:
        _line(ax, x, m["kv_use"], marker=".", label="mean over rollouts")
    else:
        return _none(ax, "KV use")
    ax.set(xlabel=label, ylabel="KV cache in use (fraction)")
    ax.legend(fontsize="small")


def _repack(ax, run: Run) -> None:
    x, xe, label = _clock(run)
    m, e = run.metrics, run.events
    samples = (e["kind"] == "kv_sample") if "kind" in e else pd.Series(False, index=e.index)
    if samples.any() and "gen_tokens_per_s" in e:  # the simulator samples finer than per step
        ax.plot(xe[samples], e.loc[samples, "gen_tokens_per_s"], label="generated tokens/s")
    elif "gen_tokens_per_s" in m:
        _line(ax, x, m["gen_tokens_per_s"], marker=".", label="generated tokens/s")
    times = xe[e["kind"] == "repack"].dropna() if "kind" in e else pd.Series([], dtype=float)
    for i, t in enumerate(times):
        ax.axvline(t, color="tab:red", alpha=0.5, lw=1, label="repack" if i == 0 else None)
    if not len(times) and "gen_tokens_per_s" not in m:
        return _none(ax, "repack events")
    ax.set(xlabel=label, title=f"{len(times)} repack events")
    ax.legend(fontsize="small")


def _idle(ax, run: Run) -> None:
    x, _, label = _clock(run)
    m = run.metrics
    cols = [c for c in ("learner_idle_frac", "rollout_idle_frac", "accelerator_idle_frac") if c in m]
    if not cols:
        return _none(ax, "idle fractions")
    for c in cols:
        _line(ax, x, m[c], marker=".", label=c.replace("_idle_frac", ""))
    ax.set(xlabel=label, ylabel="idle fraction", ylim=(-0.02, 1.02))
    ax.legend(fontsize="small")


_DRAW: dict[str, Callable] = {"reward": _reward, "throughput": _throughput, "staleness": _staleness,
                              "kv": _kv, "repack": _repack, "idle": _idle}


def figure(panel: str, runs: Sequence[Run]):
    """One matplotlib Figure of `panel` with a column per run."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(5 * len(runs), 3.6), layout="constrained")
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    for ax, run in zip(axes, runs):
        _DRAW[panel](ax, run)
        ax.set_title(f"{run.name}" + (f"\n{ax.get_title()}" if ax.get_title() else ""), fontsize="medium")
        ax.grid(alpha=0.3)
    fig.suptitle(panel)
    return fig


def plot_runs(paths: Sequence[str | pathlib.Path], out_dir: str | pathlib.Path,
              panels: Sequence[str] = PANELS) -> list[pathlib.Path]:
    """Write `<out_dir>/<panel>.png` for every panel; returns the paths."""
    runs = [load_run(p) for p in paths]
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for panel in panels:
        path = out / f"{panel}.png"
        figure(panel, runs).savefig(path, dpi=100)
        written.append(path)
    return written


def main(argv: Sequence[str]) -> int:
    """`laminar plot RUN [RUN ...] [--out DIR]` (default: RUN/plots for one run, ./plots for several)."""
    p = argparse.ArgumentParser(prog="laminar plot")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (real or simulated)")
    p.add_argument("--out", default=None, help="folder for the PNGs")
    p.add_argument("--panels", default=",".join(PANELS), help=f"comma-separated subset of {','.join(PANELS)}")
    ns = p.parse_args(list(argv))
    panels = [x for x in ns.panels.split(",") if x]
    bad = [x for x in panels if x not in PANELS]
    if bad:
        raise ValueError(f"--panels: unknown {bad}; choose among {', '.join(PANELS)}")
    out = ns.out or (pathlib.Path(ns.runs[0]) / "plots" if len(ns.runs) == 1 else pathlib.Path("plots"))
    for path in plot_runs(ns.runs, out, panels):
        print(path)
    return 0
