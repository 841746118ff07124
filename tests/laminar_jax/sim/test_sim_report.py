"""Run folders: vectorised trajectory columns equal the per-row reference, run.write levels,
unsteady cells are never printed as a throughput."""
import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from laminar_jax.analysis import load_run
from laminar_jax.manager import modes
from laminar_jax.metrics import RunWriter
from laminar_jax.sim import report
from laminar_jax.sim.cli import simulate
from laminar_jax.sim.engine import Sim
from tests.laminar_jax.sim.test_sim_engine import tiny

SYSTEMS = [{"name": "lam", "mode": "laminar", "max_concurrency": 16, "relays": True}]
CELLS = [{"system": "lam", "accelerators": 3, "train": 1, "rollout": 2}]


def reference_rows(sim):
    """The trajectory log the old way: one Python dict per consumed trajectory."""
    ts = sim.ts
    rows = []
    for i, v, t in sim.consumed:
        tools = ts.tools[i]
        calls = 0 if tools is None else len(tools[0])
        rows.append({"id": i, "group": ts.group[i], "prompt_len": ts.prompt[i],
                     "response_len": ts.resp[i] + (0 if tools is None else calls * tools[2]),
                     "tool_calls": calls, "tool_failed": 0 if tools is None else sum(tools[3]),
                     "tool_wait_s": ts.tool_wait[i], "gen_version": ts.gen_version[i],
                     "learner_version": v, "staleness": modes.staleness(v, ts.gen_version[i]),
                     "rollout": ts.first_rollout[i], "repacks": ts.repacks[i],
                     "preemptions": ts.preempts[i], "versions": ts.versions[i],
                     "start_time": ts.start_t[i], "finish_time": ts.finish_t[i],
                     "consume_time": t, "latency_s": ts.finish_t[i] - ts.start_t[i]})
    return rows


def test_columns_equal_the_per_row_reference(tmp_path):
    cfg = tiny(SYSTEMS, CELLS, **{"workload.tools.max_calls": 2,
                                  "workload.response.kind": "lognormal",
                                  "workload.response.sigma": 0.5})
    sim = Sim(cfg, cfg.cells[0]).run()
    report.write_run(sim, tmp_path / "a", tensorboard=False)
    got = load_run(tmp_path / "a").trajectories
    want = pd.DataFrame.from_records(reference_rows(sim))
    assert list(got.columns) == list(want.columns)
    assert (got["tool_calls"] > 0).any()
    pd.testing.assert_frame_equal(got, want, check_dtype=False)
    hist = report.staleness_histogram(sim, measured_only=False)
    assert hist == dict(sorted(want["staleness"].value_counts().items()))
    # a second write of the same cell replaces the folder's rows instead of appending
    report.write_run(sim, tmp_path / "a", tensorboard=False)
    assert len(load_run(tmp_path / "a").trajectories) == len(want)


def test_log_trajectory_columns_checks_its_input(tmp_path):
    with RunWriter(tmp_path / "w", tensorboard=False) as w:
        assert w.log_trajectory_columns({"a": np.arange(3), "b": np.ones(3)}) == 3
        assert w.log_trajectory_columns({"a": np.arange(2), "b": np.zeros(2)}) == 2
        with pytest.raises(ValueError, match="'b': 2 rows, the others have 3"):
            w.log_trajectory_columns({"a": np.arange(3), "b": np.ones(2)})
        with pytest.raises(ValueError, match="1-D numeric"):
            w.log_trajectory_columns({"a": np.array(["x"])})
    assert load_run(tmp_path / "w").trajectories["a"].tolist() == [0, 1, 2, 0, 1]
    with RunWriter(tmp_path / "w2", tensorboard=False) as w:  # rows and columns mix: parts in order
        w.log_trajectories([{"a": 7}])
        w.log_trajectory_columns({"a": np.arange(3)})
    assert load_run(tmp_path / "w2").trajectories["a"].tolist() == [7, 0, 1, 2]


def test_write_levels(tmp_path):
    cfg = tiny(SYSTEMS, CELLS, **{"run.out_dir": str(tmp_path)})
    for level in ("full", "summary", "none"):
        c = dataclasses.replace(cfg, name=level, run=dataclasses.replace(cfg.run, write=level))
        simulate(c)
    full, summ = tmp_path / "full" / "lam_3", tmp_path / "summary" / "lam_3"
    assert len(load_run(full).trajectories) > 0 and len(load_run(full).metrics) > 0
    assert len(load_run(summ).metrics) > 0 and len(load_run(summ).trajectories) == 0
    kinds = [json.loads(x)["kind"] for x in (summ / "events.jsonl").read_text().splitlines()]
    assert kinds == ["summary"]
    assert len((full / "events.jsonl").read_text().splitlines()) > 1
    assert not (tmp_path / "none").exists()
    # true / false still mean full / none
    assert tiny(SYSTEMS, CELLS, **{"run.write": True}).run.write == "full"
    assert tiny(SYSTEMS, CELLS, **{"run.write": False}).run.write == "none"


def test_an_unsteady_cell_is_not_printed_as_a_throughput():
    # a learner 4x slower than two rollouts with an unbounded buffer: staleness keeps rising
    cfg = tiny(SYSTEMS, CELLS, **{"model.trainer.seconds_per_token": 4e-3,
                                  "data.buffer_groups": 10_000, "run.warmup_steps": 4,
                                  "run.measure_steps": 8})
    res = report.cell_result(Sim(cfg, cfg.cells[0]).run())
    assert not res.steady and np.isnan(res.reported) and res.throughput > 0
    assert "unsteady" in report.markdown_table([res], tolerance=0.25)
