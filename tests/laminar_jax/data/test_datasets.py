"""Dataset files: JSONL / JSON / Parquet, bad rows reported with file and location."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from laminar_jax.config import DataConfig
from laminar_jax.data import DatasetError, load_dataset, load_prompt_file


def test_jsonl_bad_rows_are_reported_and_good_rows_kept(tmp_path, caplog):
    path = tmp_path / "train.jsonl"
    lines = [
        json.dumps({"prompt": "1+1=", "answer": "2"}),
        json.dumps({"question": "no prompt"}),
        "{not json",
        "",
        json.dumps({"prompt": 5, "answer": "x"}),
        json.dumps(["a", "list"]),
        json.dumps({"prompt": "  ", "answer": "x"}),
        json.dumps({"prompt": "2+2=", "id": "q7", "extra": [1, 2]}),
        json.dumps({"prompt": "dup", "id": "q7"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    ds = load_prompt_file(str(path))
    assert [(r.prompt_id, r.prompt, r.answer) for r in ds.rows] == [("train-1", "1+1=", "2"), ("q7", "2+2=", None)]
    assert ds.rows[1].row == {"prompt": "2+2=", "id": "q7", "extra": [1, 2]}
    assert ds.rows[1].source == f"{path} line 8"
    bad = {b.location: b.reason for b in ds.bad_rows}
    assert set(bad) == {"line 2", "line 3", "line 5", "line 6", "line 7", "line 9"}
    assert "no field 'prompt' (fields: question)" in bad["line 2"]
    assert "invalid JSON" in bad["line 3"]
    assert "is int, expected a string" in bad["line 5"]
    assert "got list" in bad["line 6"]
    assert "is empty" in bad["line 7"]
    assert "duplicate id 'q7'" in bad["line 9"]
    assert all(b.source == str(path) for b in ds.bad_rows)
    assert ds.num_bad == 6 and "2 prompts, 6 bad rows skipped" in ds.report()
    assert str(path) in caplog.text and "line 2" in caplog.text


def test_parquet_bad_rows_by_row_number(tmp_path):
    path = tmp_path / "math.parquet"
    table = pa.table({"problem": ["What is 3*4?", None, "Solve x+1=2", ""],
                      "solution": ["12", "1", None, "0"], "level": [1, 2, 3, 4]})
    pq.write_table(table, path)
    ds = load_prompt_file(str(path), prompt_field="problem", answer_field="solution")
    assert [(r.prompt_id, r.answer, r.row["level"]) for r in ds.rows] == [("math-0", "12", 1), ("math-2", None, 3)]
    assert [(b.location, b.reason) for b in ds.bad_rows] == [("row 1", "field 'problem' is null"),
                                                             ("row 3", "field 'problem' is empty")]
    assert str(ds.bad_rows[0]) == f"{path}: row 1: field 'problem' is null"


def test_json_array_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": 1}]))
    ds = load_prompt_file(str(path))
    assert [r.prompt for r in ds.rows] == ["a"] and ds.bad_rows[0].location == "item 1"


def test_unusable_files_are_errors_naming_the_file(tmp_path):
    empty = tmp_path / "bad.jsonl"
    empty.write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"text": "y"}) + "\n")
    with pytest.raises(DatasetError, match=r"bad\.jsonl: no usable prompt rows \(2 bad rows; first: line 1: no field"):
        load_prompt_file(str(empty))
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "nocol.parquet")
    with pytest.raises(DatasetError, match=r"nocol\.parquet: no usable prompt rows .*no field 'prompt'"):
        load_prompt_file(str(tmp_path / "nocol.parquet"))
    with pytest.raises(DatasetError, match="missing.jsonl: no such dataset file"):
        load_prompt_file(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("prompt\na\n")
    with pytest.raises(DatasetError, match=r"x\.csv: unknown dataset format"):
        load_prompt_file(str(tmp_path / "x.csv"))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"junk\.parquet: cannot read Parquet"):
        load_prompt_file(str(tmp_path / "junk.parquet"))


def test_load_dataset_from_config(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "hi", "a": "yo"}) + "\n")
    ds = load_dataset(DataConfig(task="math", path=str(path), prompt_field="q", answer_field="a"))
    assert [(r.prompt, r.answer) for r in ds.rows] == [("hi", "yo")]
    ds = load_dataset(DataConfig(task="arithmetic", num_prompts=10, task_max_n=3))
    assert len(ds.rows) == 10 and all(int(r.row["a"]) <= 3 for r in ds.rows)
    with pytest.raises(DatasetError, match="'math' is not a built-in task .* data.path is not set"):
        load_dataset(DataConfig(task="math"))
