"""Prompt datasets: local JSONL / JSON / Parquet files, or a built-in task.

A row needs a string `prompt_field`; `answer_field` is optional (None when absent: a user reward
may need only the row). A row id comes from `id_field` when present, else "<file stem>-<n>".
Bad rows (invalid JSON, bytes that are not UTF-8, not an object, missing / null / non-string / empty prompt) are skipped
and reported as `BadRow`s with the file and location: "line N" (1-based) in JSON lines,
"item N" (0-based) in a JSON array, "row N" (0-based, as pandas counts) in Parquet. Loading goes
on with the good rows; a file with no good row is a `DatasetError` naming the file.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from laminar_jax.data.records import PromptRow
from laminar_jax.data.tasks import TASKS, get_task

log = logging.getLogger(__name__)

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


class DatasetError(ValueError):
    """A dataset that cannot be used at all (missing file, unknown format, no good rows)."""


@dataclass(frozen=True)
class BadRow:
    """A skipped row: the file, where in it ("line 7", "row 3"), and why."""

    source: str
    location: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}: {self.location}: {self.reason}"


@dataclass(frozen=True)
class LoadedDataset:
    """The good rows of a dataset and a report of the bad ones."""

    source: str
    rows: tuple[PromptRow, ...]
    bad_rows: tuple[BadRow, ...] = ()

    @property
    def num_bad(self) -> int:
        return len(self.bad_rows)

    def report(self, max_listed: int = 5) -> str:
        text = f"{self.source}: {len(self.rows)} prompts, {self.num_bad} bad rows skipped"
        listed = [str(b) for b in self.bad_rows[:max_listed]]
        more = self.num_bad - len(listed)
        return "\n  ".join([text, *listed] + ([f"... and {more} more"] if more > 0 else []))


def _check_row(row: Any, prompt_field: str) -> str | None:
    """Why `row` cannot be used (None when it can)."""
    if not isinstance(row, Mapping):
        return f"expected an object with a {prompt_field!r} field, got {type(row).__name__}"
    if prompt_field not in row:
        fields = ", ".join(map(str, list(row)[:10])) or "none"
        return f"no field {prompt_field!r} (fields: {fields})"
    prompt = row[prompt_field]
    if prompt is None:
        return f"field {prompt_field!r} is null"
    if not isinstance(prompt, str):
        return f"field {prompt_field!r} is {type(prompt).__name__}, expected a string"
    if not prompt.strip():
        return f"field {prompt_field!r} is empty"
    return None


def _json_rows(path: str) -> Iterator[tuple[str, Any, str | None]]:
    """(location, row, parse error) for each record of a JSON-lines file or JSON array.

    Lines are decoded one by one, so bytes that are not UTF-8 cost only their own line (reported
    like invalid JSON); a JSON array is one document and must be UTF-8 as a whole.
    """
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".json") and data.lstrip().startswith(b"["):
        try:
            items = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise DatasetError(f"{path}: line {line}: not UTF-8 (byte 0x{data[e.start]:02x}); "
                               "a JSON array must be UTF-8 throughout") from None
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: invalid JSON array ({e})") from None
        for i, item in enumerate(items):
            yield f"item {i}", item, None
        return
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            yield (f"line {lineno}", None,
                   f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
            continue
        if not line.strip():
            continue
        try:
            yield f"line {lineno}", json.loads(line), None
        except json.JSONDecodeError as e:
            yield f"line {lineno}", None, f"invalid JSON ({e.msg} at column {e.colno})"


def _parquet_rows(path: str) -> Iterator[tuple[str, Any, str | None]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise DatasetError(f"{path}: cannot read Parquet ({type(e).__name__}: {e})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i}", row, None


def load_prompt_file(path: str, *, prompt_field: str = "prompt", answer_field: str = "answer",
                     id_field: str = "id") -> LoadedDataset:
    """Read a JSONL / JSON / Parquet prompt file (module docstring for the rules)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: no such dataset file")
    if path.endswith(JSON_SUFFIXES):
        records = _json_rows(path)
    elif path.endswith(PARQUET_SUFFIXES):
        records = _parquet_rows(path)
    else:
        raise DatasetError(f"{path}: unknown dataset format; expected one of "
                           f"{JSON_SUFFIXES + PARQUET_SUFFIXES}")
    stem = os.path.splitext(os.path.basename(path))[0]
    rows, bad, seen_ids = [], [], set()
    for location, row, error in records:
        error = error or _check_row(row, prompt_field)
        if error is None:
            rid = row.get(id_field)
            prompt_id = str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) \
                else f"{stem}-{location.split()[-1]}"
            if prompt_id in seen_ids:
                error = f"duplicate id {prompt_id!r} in field {id_field!r}"
        if error is not None:
            bad.append(BadRow(path, location, error))
            continue
        seen_ids.add(prompt_id)
        rows.append(PromptRow(prompt_id, row[prompt_field], row.get(answer_field), dict(row),
                              f"{path} {location}"))
    dataset = LoadedDataset(path, tuple(rows), tuple(bad))
    if not rows:
        first = f"; first: {bad[0].location}: {bad[0].reason}" if bad else ""
        raise DatasetError(f"{path}: no usable prompt rows ({len(bad)} bad rows{first})")
    if bad:
        log.warning("%s", dataset.report())
    return dataset


def load_dataset(cfg, *, seed: int = 0) -> LoadedDataset:
    """The prompts a `DataConfig` names: the file at `cfg.path` when set, else a built-in task.

    With a path, `cfg.task` is only a label (e.g. "math"); without, it must name a built-in task.
    """
    if cfg.path is not None:
        return load_prompt_file(cfg.path, prompt_field=cfg.prompt_field, answer_field=cfg.answer_field,
                                id_field=cfg.id_field)
    if cfg.task not in TASKS:
        raise DatasetError(f"data.task: {cfg.task!r} is not a built-in task ({sorted(TASKS)}) and "
                           f"data.path is not set; give a JSONL / Parquet file in data.path")
    task = get_task(cfg.task, num_prompts=cfg.num_prompts,
                    max_n=cfg.task_max_n, seed=seed)
    return LoadedDataset(f"task {cfg.task}", tuple(task.rows()))
