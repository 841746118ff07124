"""The run folder writer: what a run leaves behind for notebooks and TensorBoard.

    run_dir/
      config.yaml            the resolved config
      metrics.parquet        one row per learner step (column "step" + whatever was logged)
      trajectories.parquet   one row per consumed trajectory
      events.jsonl           one JSON object per line: {"time": unix seconds, "kind": ..., ...}
      tb/                    TensorBoard scalars of every numeric metric

Parquet files are rewritten whole at each flush (every `flush_every` steps and on close) through
a temporary file and an atomic rename, so a crashed run keeps a readable file with every row up
to its last flush; appending row groups would instead leave a file without a footer, and could
not add the columns that appear later in a run. Events are flushed line by line.
Reopening an existing folder (a resumed run) keeps its rows; logging a step at or before the last
stored one drops the stored rows from that step on (they came from after the checkpoint).

No jax import: values may be numpy or jax scalars, converted with `.item()`.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import os
import pathlib
import sys
import time
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from laminar_jax.config_loader import dump_yaml

__all__ = ["RunWriter", "CONFIG_FILE", "METRICS_FILE", "TRAJECTORIES_FILE", "EVENTS_FILE",
           "TB_DIR"]

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.parquet"
TRAJECTORIES_FILE = "trajectories.parquet"
EVENTS_FILE = "events.jsonl"
TB_DIR = "tb"


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


def _kind(value: Any) -> str | None:
    """Parquet column kind of a value; a column must keep one kind (None fits any)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def _check_kinds(kinds: dict[str, str], row: Mapping[str, Any], *, what: str) -> None:
    for name, value in row.items():
        kind = _kind(value)
        if kind is not None and kinds.setdefault(name, kind) != kind:
            raise ValueError(f"{what} {name!r}: got a {kind} ({value!r}) in a column of "
                             f"{kinds[name]} values; a Parquet column holds one type")


def _write_parquet(rows: list[dict], path: pathlib.Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pd.DataFrame.from_records(rows).to_parquet(tmp, index=False)
    os.replace(tmp, path)


def _import_tensorboardx():
    # tensorboardX.writer imports torch when it is installed (for a type check only); laminar_jax
    # must not pull torch in, so hide it during the import unless something else loaded it.
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import tensorboardX
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return tensorboardX


class RunWriter:
    """Writes one run folder. Use as a context manager, or call `close()`.

    Args:
      run_dir: the folder (created with its parents).
      config: a config dataclass or dict, dumped to config.yaml (an existing one is replaced).
      flush_every: learner steps between Parquet rewrites.
      tensorboard: also write TensorBoard scalars under tb/.
    """

    def __init__(self, run_dir: str | os.PathLike, config: Any = None, *, flush_every: int = 10,
                 tensorboard: bool = True):
        if flush_every < 1:
            raise ValueError(f"flush_every: expected an int >= 1, got {flush_every!r}")
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.flush_every = flush_every
        if config is not None:
            (self.run_dir / CONFIG_FILE).write_text(dump_yaml(config))
        self._steps = self._read_existing(METRICS_FILE)
        self._trajectories = self._read_existing(TRAJECTORIES_FILE)
        self._step_kinds: dict[str, str] = {}
        self._trajectory_kinds: dict[str, str] = {}
        for row in self._steps:
            _check_kinds(self._step_kinds, row, what="metric")
        for row in self._trajectories:
            _check_kinds(self._trajectory_kinds, row, what="trajectory field")
        self._since_flush = 0
        self._events = open(self.run_dir / EVENTS_FILE, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            self._tb = _import_tensorboardx().SummaryWriter(logdir=str(self.run_dir / TB_DIR))
        self._closed = False

    def _read_existing(self, name: str) -> list[dict]:
        path = self.run_dir / name
        if not path.is_file():
            return []
        # NaN cells are columns a row did not have; drop them so the kind checks see the rest.
        return [{k: _plain(v) for k, v in row.items() if not (isinstance(v, float) and v != v)}
                for row in pd.read_parquet(path).to_dict("records")]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"RunWriter({self.run_dir}) is closed")

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record the metrics of learner step `step` (one metrics.parquet row)."""
        self._check_open()
        step = int(_scalar(step, name="step"))
        if "step" in metrics:
            raise ValueError("metrics: 'step' is the row key; pass it as the step argument")
        row = {"step": step}
        for name, value in metrics.items():
            row[str(name)] = _scalar(value, name=str(name))
        kinds = dict(self._step_kinds)  # a rejected row must not register its columns
        _check_kinds(kinds, row, what="metric")
        self._step_kinds = kinds
        if self._steps and self._steps[-1]["step"] >= step:
            self._steps = [r for r in self._steps if r["step"] < step]
        self._steps.append(row)
        if self._tb is not None:
            for name, value in row.items():
                if name != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool):
                    self._tb.add_scalar(name, float(value), global_step=step)
        self._since_flush += 1
        if self._since_flush >= self.flush_every:
            self.flush()

    def log_trajectories(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Record consumed trajectories (ids, lengths, reward, gen_version, staleness, ...)."""
        self._check_open()
        rows = [{str(k): _plain(v) for k, v in row.items()} for row in rows]
        kinds = dict(self._trajectory_kinds)
        for row in rows:
            _check_kinds(kinds, row, what="trajectory field")
        self._trajectory_kinds = kinds
        self._trajectories.extend(rows)

    def log_trajectory_columns(self, columns: Mapping[str, Any]) -> int:
        """Record consumed trajectories given as columns {name: 1-D array}, all of one length.

        The vectorised form of `log_trajectories` for large batches (the simulator's ~1e5 rows
        per cell): an Arrow table is built from the arrays and trajectories.parquet is rewritten
        at once, with no per-value Python. Numeric and bool arrays only. A run folder uses
        either this or `log_trajectories` (mixing them would make the whole-file rewrite at
        flush drop one of them), so this raises when rows of the other kind are held.
        Returns the number of rows written.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._check_open()
        if self._trajectories:
            raise ValueError(f"RunWriter({self.run_dir}).log_trajectory_columns: the folder "
                             f"already holds {len(self._trajectories)} log_trajectories rows; "
                             "use one of the two per run folder")
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
        table = pa.table(arrays)
        path = self.run_dir / TRAJECTORIES_FILE
        if path.is_file():
            table = pa.concat_tables([pq.read_table(path), table], promote_options="default")
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)
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
        """Rewrite the Parquet files with every row so far and flush TensorBoard."""
        self._check_open()
        if self._steps:
            _write_parquet(self._steps, self.run_dir / METRICS_FILE)
        if self._trajectories:
            _write_parquet(self._trajectories, self.run_dir / TRAJECTORIES_FILE)
        if self._tb is not None:
            self._tb.flush()
        self._since_flush = 0

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._events.close()
            if self._tb is not None:
                self._tb.close()

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def num_steps(self) -> int:
        return len(self._steps)
