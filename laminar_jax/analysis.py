"""Load run folders (written by `laminar_jax.metrics.RunWriter`, real or simulated) into pandas.

    run = load_run("runs/default")
    run.metrics.plot(x="step", y="loss")
    run.events[run.events.kind == "publish"]

Optional files may be missing (a run that crashed early, or one without trajectories); they load
as empty frames. No jax import.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Iterable

import pandas as pd

from laminar_jax.config_loader import yaml_load
from laminar_jax.runfiles import (CONFIG_FILE, EVENTS_FILE, METRICS_DIR, METRICS_FILE,
                                  TRAJECTORIES_DIR, TRAJECTORIES_FILE, read_table)

__all__ = ["Run", "find_runs", "load_events", "load_metrics", "load_run", "reward_gain"]

_RUN_FILES = (CONFIG_FILE, METRICS_FILE, EVENTS_FILE)
_RUN_DIRS = (METRICS_DIR,)


@dataclasses.dataclass
class Run:
    """One run folder: the resolved config (plain dict) and its logs as DataFrames."""

    path: pathlib.Path
    config: dict
    metrics: pd.DataFrame
    trajectories: pd.DataFrame
    events: pd.DataFrame

    @property
    def name(self) -> str:
        return self.path.name


def _empty_events() -> pd.DataFrame:
    return pd.DataFrame({"time": pd.Series(dtype="float64"), "kind": pd.Series(dtype="object")})


def load_events(path: str | pathlib.Path) -> pd.DataFrame:
    """events.jsonl as a DataFrame (columns time, kind, then every field seen, NaN-filled).

    A last line cut short by a crash is skipped; a bad line elsewhere is an error.
    """
    path = pathlib.Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON event line: {e}") from None
    if not records:
        return _empty_events()
    frame = pd.DataFrame.from_records(records)
    return frame[["time", "kind"] + [c for c in frame.columns if c not in ("time", "kind")]]


def load_run(path: str | pathlib.Path) -> Run:
    """Load a run folder. Raises `FileNotFoundError` / `ValueError` naming the folder."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such run folder")
    if not any((path / f).is_file() for f in _RUN_FILES) and not any((path / d).is_dir() for d in _RUN_DIRS):
        raise ValueError(f"{path}: not a run folder (it has none of "
                         f"{', '.join(_RUN_FILES + tuple(d + '/' for d in _RUN_DIRS))})")

    config: dict = {}
    if (path / CONFIG_FILE).is_file():
        loaded = yaml_load((path / CONFIG_FILE).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path / CONFIG_FILE}: expected a mapping, got {type(loaded).__name__}")
        config = loaded or {}

    metrics = read_table(path / METRICS_DIR, path / METRICS_FILE)
    if metrics is not None:
        metrics = metrics.sort_values("step", kind="stable").reset_index(drop=True)
    else:
        metrics = pd.DataFrame({"step": pd.Series(dtype="int64")})

    trajectories = read_table(path / TRAJECTORIES_DIR, path / TRAJECTORIES_FILE)
    if trajectories is None:
        trajectories = pd.DataFrame()
    events = (load_events(path / EVENTS_FILE) if (path / EVENTS_FILE).is_file()
              else _empty_events())
    return Run(path=path, config=config, metrics=metrics, trajectories=trajectories,
               events=events)


def find_runs(root: str | pathlib.Path) -> list[pathlib.Path]:
    """Every run folder under `root` (itself included), sorted by path."""
    root = pathlib.Path(root)
    found = {p.parent for name in _RUN_FILES for p in root.rglob(name) if p.is_file()}
    found |= {p.parent for name in _RUN_DIRS for p in root.rglob(name) if p.is_dir()}
    return sorted(found)


def load_metrics(paths: Iterable[str | pathlib.Path]) -> pd.DataFrame:
    """The metrics of several runs in one frame, with a `run` column (the folder name)."""
    frames = []
    for p in paths:
        run = load_run(p)
        frames.append(run.metrics.assign(run=run.name))
    if not frames:
        return pd.DataFrame({"run": pd.Series(dtype="object"), "step": pd.Series(dtype="int64")})
    frame = pd.concat(frames, ignore_index=True)
    return frame[["run"] + [c for c in frame.columns if c != "run"]]


def reward_gain(trajectories: pd.DataFrame, *, strata: str = "prompt_len", fraction: float = 1 / 3,
                time: str = "gen_version") -> dict[str, float]:
    """Mean reward early vs late in a run, compared within strata of equal difficulty.

    A run's mean reward per step moves with the prompts it happens to draw (a long countdown is
    harder than a short one, and in asynchronous modes short answers arrive first), so the raw
    first-vs-last comparison is noisy. Trajectories with `time` in the first `fraction` of its
    range are "early", those in the last `fraction` "late"; for every value s of the `strata`
    column seen in both, with n_s = min(#early_s, #late_s):

        early = sum_s n_s mean(early_s) / sum_s n_s,   late likewise,   gain = late - early.

    The default strata, `prompt_len`, compares prompts of equal token length, a difficulty proxy
    every run's trajectories carry; a task-specific column (countdown's n) is sharper. (A prompt
    id is no stratum: a run shorter than an epoch draws each prompt once, so no id is both early
    and late.)

    Returns {"early", "late", "gain", "strata", "early_count", "late_count"} (NaN gain when no
    stratum is in both parts).
    """
    for col in (strata, time, "reward"):
        if col not in trajectories.columns:
            raise KeyError(f"reward_gain: trajectories have no column {col!r} "
                           f"(columns: {sorted(trajectories.columns)})")
    if not 0 < fraction <= 0.5:
        raise ValueError(f"reward_gain: fraction must be in (0, 0.5], got {fraction}")
    t = trajectories[time].astype(float)
    lo, hi = t.min(), t.max()
    span = hi - lo
    early = trajectories[t <= lo + fraction * span]
    late = trajectories[t >= hi - fraction * span]
    e = early.groupby(strata)["reward"].agg(["mean", "size"])
    l = late.groupby(strata)["reward"].agg(["mean", "size"])
    both = e.join(l, lsuffix="_early", rsuffix="_late", how="inner")
    w = both[["size_early", "size_late"]].min(axis=1).astype(float)
    if span == 0 or w.sum() == 0:
        nan = float("nan")
        return {"early": nan, "late": nan, "gain": nan, "strata": 0,
                "early_count": int(len(early)), "late_count": int(len(late))}
    e_mean = float((both["mean_early"] * w).sum() / w.sum())
    l_mean = float((both["mean_late"] * w).sum() / w.sum())
    return {"early": e_mean, "late": l_mean, "gain": l_mean - e_mean, "strata": int(len(both)),
            "early_count": int(len(early)), "late_count": int(len(late))}
