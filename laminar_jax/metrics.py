"""The run folder writer: what a run leaves behind for notebooks, TensorBoard and W&B.

    run_dir/
      config.yaml                     the resolved config
      metrics/part-*.parquet          one row per learner step (column "step" + whatever was logged)
      trajectories/part-*.parquet     one row per consumed trajectory ("step": the learner step)
      events.jsonl                    one JSON object per line: {"time": unix seconds, "kind": ..., ...}
      tb/, wandb/                     the trackers' copies of every numeric metric (run.trackers)

Metrics and trajectories are append-only Parquet part files (`laminar_jax.runfiles`): each flush
(every `flush_every` steps or `flush_every_s` seconds, and on close) writes the rows buffered since
the last one as a new part, through a temporary file and an atomic rename. A crash keeps every
part written; the writer holds only the rows since its last flush, so its memory does not grow
with the run. `analysis.load_run` reads the parts as one table (the table the single
metrics.parquet / trajectories.parquet of older run folders held; those still load).
Reopening an existing folder (a resumed run) keeps its parts; `rewind(step)`, or logging a step at
or before the last stored one, drops the stored rows from that step on (they came from after the
checkpoint), so a resumed run has each step and each trajectory once. Events are flushed line by line.

No jax import: values may be numpy or jax scalars, converted with `.item()`.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import os
import pathlib
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from laminar_jax.config_loader import dump_yaml
from laminar_jax.runfiles import (CONFIG_FILE, EVENTS_FILE, METRICS_DIR, METRICS_FILE, TB_DIR,
                                  TRAJECTORIES_DIR, TRAJECTORIES_FILE, PartLog)
from laminar_jax.trackers import _import_tensorboardx, make_trackers

__all__ = ["RunWriter", "CONFIG_FILE", "METRICS_FILE", "TRAJECTORIES_FILE", "EVENTS_FILE",
           "TB_DIR", "METRICS_DIR", "TRAJECTORIES_DIR", "exact_rate", "_import_tensorboardx"]

EXACT_REWARD = 1.0  # full credit: the built-in tasks give < 1 for a partly right answer


def exact_rate(rewards: Sequence[float]) -> float:
    """Fraction of trajectories with full reward (>= 1.0, an exact answer); NaN when empty."""
    r = np.asarray(rewards, dtype=float)
    return float(np.mean(r >= EXACT_REWARD)) if r.size else float("nan")


def _scalar(value: Any, *, name: str) -> Any:
    """A python int / float / bool / str from a python, numpy or jax scalar."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    arr = np.asarray(value)
    if arr.size != 1 or arr.dtype.kind not in "biuf":
        raise ValueError(f"metric {name!r}: expected a scalar number, bool or str, "
                         f"got {type(value).__name__} with shape {arr.shape}")
    return arr.reshape(()).item()


def _plain(value: Any) -> Any:
    """JSON / Parquet-friendly form of event and trajectory fields."""
    if isinstance(value, (np.generic, np.ndarray)) or hasattr(value, "__array__"):
        arr = np.asarray(value)
        return arr.item() if arr.ndim == 0 else arr.tolist()
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _trackers_of(config: Any, tensorboard: bool | None) -> tuple[str, ...]:
    run = getattr(config, "run", None)
    names = list(getattr(run, "trackers", ("tensorboard",)))
    if tensorboard is False and "tensorboard" in names:
        names.remove("tensorboard")
    if tensorboard is True and "tensorboard" not in names:
        names.insert(0, "tensorboard")
    return tuple(names)


class RunWriter:
    """Writes one run folder. Use as a context manager, or call `close()`.

    Args:
      run_dir: the folder (created with its parents).
      config: a config dataclass or dict, dumped to config.yaml (an existing one is replaced;
        `laminar_jax.runtime.run_folder` decides beforehand whether that is allowed).
      flush_every / flush_every_s: steps / seconds between part-file flushes.
      tensorboard: False drops TensorBoard from the trackers, True adds it (None: as configured).
      trackers: tracker names (default: `config.run.trackers`, else ["tensorboard"]).
    """

    def __init__(self, run_dir: str | os.PathLike, config: Any = None, *, flush_every: int = 10,
                 flush_every_s: float = 30.0, tensorboard: bool | None = None,
                 trackers: Sequence[str] | None = None):
        if flush_every < 1:
            raise ValueError(f"flush_every: expected an int >= 1, got {flush_every!r}")
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.flush_every, self.flush_every_s = flush_every, float(flush_every_s)
        if config is not None:
            (self.run_dir / CONFIG_FILE).write_text(dump_yaml(config))
        self._metrics = PartLog(self.run_dir / METRICS_DIR, what="metric")
        self._trajectories = PartLog(self.run_dir / TRAJECTORIES_DIR, what="trajectory field")
        self._since_flush, self._flushed_at = 0, time.monotonic()
        self._events = open(self.run_dir / EVENTS_FILE, "a", encoding="utf-8")
        names = tuple(trackers) if trackers is not None else _trackers_of(config, tensorboard)
        self._trackers = make_trackers(names, self.run_dir, config)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"RunWriter({self.run_dir}) is closed")

    @property
    def last_step(self) -> int | None:
        """The last step stored or buffered (None: none yet)."""
        return self._metrics.last_step

    def rewind(self, step: int) -> None:
        """Drop every stored metric row and trajectory of `step` and later (a resume from the
        checkpoint taken after step - 1: those rows are redone)."""
        self._check_open()
        self._metrics.rewind(int(step))
        self._trajectories.rewind(int(step))

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record the metrics of learner step `step` (one metrics row)."""
        self._check_open()
        step = int(_scalar(step, name="step"))
        if "step" in metrics:
            raise ValueError("metrics: 'step' is the row key; pass it as the step argument")
        row = {"step": step}
        for name, value in metrics.items():
            row[str(name)] = _scalar(value, name=str(name))
        self._metrics.check([row])  # a rejected row must not register its columns
        if self._metrics.last_step is not None and self._metrics.last_step >= step:
            self.rewind(step)
        self._metrics.add([row], step)
        scalars = {name: float(value) for name, value in row.items()
                   if name != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool)}
        for tracker in self._trackers:
            tracker.log_scalars(step, scalars)
        self._since_flush += 1
        if (self._since_flush >= self.flush_every
                or time.monotonic() - self._flushed_at >= self.flush_every_s):
            self.flush()

    def log_trajectories(self, rows: Iterable[Mapping[str, Any]], *, step: int | None = None) -> None:
        """Record consumed trajectories (ids, lengths, reward, gen_version, staleness, ...).

        With `step`, each row gets a "step" column (the learner step that consumed it), which is
        what lets a resumed run drop exactly the trajectories of the steps it redoes."""
        self._check_open()
        rows = [{str(k): _plain(v) for k, v in row.items()} for row in rows]
        if step is not None:
            step = int(step)
            rows = [dict(r, step=step) for r in rows]
        self._trajectories.check(rows)
        tag = step if step is not None else (self._metrics.last_step or 0)
        self._trajectories.add(rows, tag)
        if self._trajectories.buffered_rows >= 200_000:  # bound the buffer on huge steps too
            self._trajectories.flush()

    def log_trajectory_columns(self, columns: Mapping[str, Any]) -> int:
        """Record consumed trajectories given as columns {name: 1-D array}, all of one length.

        The vectorised form of `log_trajectories` for large batches (the simulator's ~1e5 rows
        per cell): an Arrow table is built from the arrays and written as one part, with no
        per-value Python. Numeric and bool arrays only. Returns the number of rows written.
        """
        import pyarrow as pa

        self._check_open()
        arrays, length = {}, None
        for name, values in columns.items():
            arr = np.asarray(values)
            if arr.ndim != 1 or arr.dtype.kind not in "biuf":
                raise ValueError(f"trajectory column {name!r}: expected a 1-D numeric or bool "
                                 f"array, got dtype {arr.dtype} with shape {arr.shape}")
            if length is not None and arr.shape[0] != length:
                raise ValueError(f"trajectory column {name!r}: {arr.shape[0]} rows, the "
                                 f"others have {length}")
            length = arr.shape[0]
            arrays[str(name)] = pa.array(arr)
        if not arrays:
            return 0
        last = self.last_step
        self._trajectories.write_table(pa.table(arrays), tag=0 if last is None else last)
        return int(length)

    def log_event(self, kind: str, **fields: Any) -> None:
        """Append one event line {"time": now, "kind": kind, **fields}; written immediately."""
        self._check_open()
        if "time" in fields:
            raise ValueError(f"event {kind!r}: 'time' is set by the writer (wall clock)")
        record = {"time": time.time(), "kind": kind, **{k: _plain(v) for k, v in fields.items()}}
        self._events.write(json.dumps(record, allow_nan=True) + "\n")
        self._events.flush()

    def flush(self) -> None:
        """Write the rows buffered since the last flush as new part files; flush the trackers."""
        self._check_open()
        self._metrics.flush()
        self._trajectories.flush()
        for tracker in self._trackers:
            tracker.flush()
        self._since_flush, self._flushed_at = 0, time.monotonic()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._events.close()
            for tracker in self._trackers:
                tracker.close()

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def num_steps(self) -> int:
        """Metric rows stored and buffered."""
        return self._metrics.num_rows

    @property
    def trackers(self) -> tuple[str, ...]:
        return tuple(t.name for t in self._trackers)
