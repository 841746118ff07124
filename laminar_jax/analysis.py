"""Load run folders (written by `laminar_jax.metrics.RunWriter`) into pandas.

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
from laminar_jax.metrics import CONFIG_FILE, EVENTS_FILE, METRICS_FILE, TRAJECTORIES_FILE

__all__ = ["Run", "find_runs", "load_events", "load_metrics", "load_run"]

_RUN_FILES = (CONFIG_FILE, METRICS_FILE, EVENTS_FILE)


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
    if not any((path / f).is_file() for f in _RUN_FILES):
        raise ValueError(f"{path}: not a run folder (it has none of {', '.join(_RUN_FILES)})")

    config: dict = {}
    if (path / CONFIG_FILE).is_file():
        loaded = yaml_load((path / CONFIG_FILE).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path / CONFIG_FILE}: expected a mapping, got {type(loaded).__name__}")
        config = loaded or {}

    if (path / METRICS_FILE).is_file():
        metrics = pd.read_parquet(path / METRICS_FILE).sort_values("step", kind="stable")
        metrics = metrics.reset_index(drop=True)
    else:
        metrics = pd.DataFrame({"step": pd.Series(dtype="int64")})

    trajectories = (pd.read_parquet(path / TRAJECTORIES_FILE)
                    if (path / TRAJECTORIES_FILE).is_file() else pd.DataFrame())
    events = (load_events(path / EVENTS_FILE) if (path / EVENTS_FILE).is_file()
              else _empty_events())
    return Run(path=path, config=config, metrics=metrics, trajectories=trajectories,
               events=events)


def find_runs(root: str | pathlib.Path) -> list[pathlib.Path]:
    """Every run folder under `root` (itself included), sorted by path."""
    root = pathlib.Path(root)
    found = {p.parent for name in _RUN_FILES for p in root.rglob(name) if p.is_file()}
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
