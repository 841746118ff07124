"""Run-folder file names and the append-only Parquet part log behind metrics and trajectories.

A table is a folder of parts `part-{seq:06d}-{first:08d}-{last:08d}.parquet`: seq orders them,
first / last bound the learner steps of their rows (kept in the name so a rewind touches only
the parts it must). Each part is written to a temporary file and renamed, so a reader never sees
half a part and a crash loses only the rows not flushed yet. Columns may appear or disappear from
one part to the next; `read_table` aligns them (NaN / None where a part lacks a column), which
is the table one file written from all the rows at once would hold.

No jax import.
"""
from __future__ import annotations

import os
import pathlib
import re
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:   # pandas is imported where a table is read or written: the learner imports this
    import pandas as pd   # module for its metric names and pays ~0.35 CPU s at start-up otherwise

CONFIG_FILE = "config.yaml"
EVENTS_FILE = "events.jsonl"
METRICS_DIR = "metrics"
TRAJECTORIES_DIR = "trajectories"
METRICS_FILE = "metrics.parquet"            # single-file layout of older run folders (still read)
TRAJECTORIES_FILE = "trajectories.parquet"
TB_DIR = "tb"
WANDB_DIR = "wandb"

_PART = re.compile(r"^part-(\d+)-(\d+)-(\d+)\.parquet$")


def _kind(value: Any) -> str | None:
    """Parquet column kind of a value; a column must keep one kind (None fits any)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def _arrow_kind(arrow_type) -> str | None:
    import pyarrow as pa
    if pa.types.is_boolean(arrow_type):
        return "bool"
    if pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type):
        return "number"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "str"
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return "list"
    if pa.types.is_struct(arrow_type):
        return "dict"
    return None


def parts(folder: pathlib.Path) -> list[tuple[int, int, int, pathlib.Path]]:
    """(seq, first, last, path) of every part in `folder`, by seq."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), int(m.group(2)), int(m.group(3)), folder / n)
             for n in os.listdir(folder) if (m := _PART.match(n))]
    return sorted(found)


def read_table(folder: pathlib.Path, legacy_file: pathlib.Path | None = None) -> pd.DataFrame | None:
    """Every part (after an older run folder's single file, if any) as one frame; None if none."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    paths = ([legacy_file] if legacy_file is not None and legacy_file.is_file() else [])
    tables = [t for t in (pq.read_table(p) for p in paths + [p for *_, p in parts(folder)]) if t.num_rows]
    if not tables:
        return None
    # arrow's schema promotion: a column missing from a part is null there, int + float -> float
    return pa.concat_tables(tables, promote_options="permissive").to_pandas()


def _write(rows: list[dict], path: pathlib.Path) -> None:
    import pandas as pd
    tmp = path.with_name(f".{path.name}.tmp")
    pd.DataFrame.from_records(rows).to_parquet(tmp, index=False)
    os.replace(tmp, path)


class PartLog:
    """One table of a run folder: rows buffered in memory until `flush()` writes them as a part.

    Each buffered row carries a step tag (its "step" column when it has one); `rewind(step)`
    drops buffered rows and stored rows tagged `step` or later.
    """

    def __init__(self, folder: pathlib.Path, *, what: str):
        self.folder, self.what = pathlib.Path(folder), what
        self.kinds: dict[str, str] = {}
        self._rows: list[dict] = []
        self._tags: list[int] = []
        self._stored_rows = 0
        self._seq, self._stored_last = 0, None
        import pyarrow.parquet as pq
        for seq, _, last, path in parts(self.folder):
            meta = pq.ParquetFile(path)
            self._stored_rows += meta.metadata.num_rows
            for f in meta.schema_arrow:
                kind = _arrow_kind(f.type)
                if kind is not None:
                    self.kinds.setdefault(f.name, kind)
            self._seq = seq + 1
            self._stored_last = last if self._stored_last is None else max(self._stored_last, last)
        for tmp in self.folder.glob(".part-*.tmp") if self.folder.is_dir() else []:
            tmp.unlink(missing_ok=True)  # a flush a crash cut short

    @property
    def last_step(self) -> int | None:
        if self._tags:
            return max(self._tags[-1], self._stored_last if self._stored_last is not None else self._tags[-1])
        return self._stored_last

    @property
    def num_rows(self) -> int:
        return self._stored_rows + len(self._rows)

    @property
    def buffered_rows(self) -> int:
        return len(self._rows)

    def check(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Raise (registering nothing) if a value's kind differs from its column's."""
        kinds = dict(self.kinds)
        for row in rows:
            for name, value in row.items():
                kind = _kind(value)
                if kind is not None and kinds.setdefault(name, kind) != kind:
                    raise ValueError(f"{self.what} {name!r}: got a {kind} ({value!r}) in a column of "
                                     f"{kinds[name]} values; a Parquet column holds one type")
        self.kinds = kinds

    def add(self, rows: Sequence[dict], tag: int) -> None:
        self._rows.extend(rows)
        self._tags.extend([int(tag)] * len(rows))

    def flush(self) -> None:
        if not self._rows:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        first, last = min(self._tags), max(self._tags)
        _write(self._rows, self.folder / f"part-{self._seq:06d}-{first:08d}-{last:08d}.parquet")
        self._stored_rows += len(self._rows)
        self._stored_last = last if self._stored_last is None else max(self._stored_last, last)
        self._seq += 1
        self._rows, self._tags = [], []

    def write_table(self, table: Any, tag: int) -> None:
        """Buffered rows first, then an Arrow table as one part of its own (the columnar path:
        no per-value Python); its rows are tagged `tag` unless it has a "step" column."""
        import pyarrow.parquet as pq
        if not table.num_rows:
            return
        self.flush()
        steps = table.column("step").to_numpy() if "step" in table.column_names else None
        first, last = (int(steps.min()), int(steps.max())) if steps is not None else (int(tag), int(tag))
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"part-{self._seq:06d}-{first:08d}-{last:08d}.parquet"
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)
        for f in table.schema:
            kind = _arrow_kind(f.type)
            if kind is not None:
                self.kinds.setdefault(f.name, kind)
        self._stored_rows += table.num_rows
        self._stored_last = last if self._stored_last is None else max(self._stored_last, last)
        self._seq += 1

    def rewind(self, step: int) -> None:
        keep = [i for i, t in enumerate(self._tags) if t < step]
        self._rows = [self._rows[i] for i in keep]
        self._tags = [self._tags[i] for i in keep]
        new_last = None
        for _, first, last, path in parts(self.folder):
            if last >= step:
                import pandas as pd
                frame = pd.read_parquet(path)
                if first >= step:
                    path.unlink()
                    self._stored_rows -= len(frame)
                    continue
                if "step" in frame.columns:  # a part straddling the step: keep its earlier rows
                    kept = frame[frame["step"] < step]
                    if len(kept) < len(frame):
                        tmp = path.with_name(f".{path.name}.tmp")
                        kept.to_parquet(tmp, index=False)
                        os.replace(tmp, path)  # same name: its "last" stays an upper bound
                        self._stored_rows -= len(frame) - len(kept)
                    last = min(last, step - 1)
            new_last = last if new_last is None else max(new_last, last)
        self._stored_last = new_last
