"""experiments/staleness_ablation.py: every arm's YAML loads and differs from the no-correction
arm only in its loss keys; the table's measures (Student-t interval, time to threshold, staleness
histogram) against closed forms on synthetic run folders."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np
import pandas as pd
import pytest

from experiments import staleness_ablation as sa
from laminar_jax.config import load_config

ARM_DIR = pathlib.Path(sa.ARM_DIR)


def flat(obj, prefix=""):
    """A config as {dotted.key: value}."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            out.update(flat(v, key + "."))
        else:
            out[key] = v
    return out


def test_every_arm_has_a_yaml_and_differs_from_none_only_in_loss():
    assert sorted(p.stem for p in ARM_DIR.glob("*.yaml")) == sorted(sa.ARMS)
    none = flat(load_config(ARM_DIR / "none.yaml"))
    assert none["loss.correction.old"] == "prox" and none["loss.correction.is_level"] == "none"
    for arm in sa.ARMS:
        cfg = flat(load_config(ARM_DIR / f"{arm}.yaml"))
        diff = {k for k in cfg if cfg[k] != none[k]}
        assert "run.name" in diff or arm == "none"
        allowed = (lambda k: k == "rollout.zero_mismatch") if arm == "zero_mismatch" else (lambda k: k.startswith("loss."))
        assert {k for k in diff - {"run.name"} if not allowed(k)} == set(), arm
        if arm != "none":
            assert diff - {"run.name"}, f"{arm} is the none arm under another name"


def test_large_level_deepens_the_buffer_and_still_validates():
    args = type("A", (), {"large_buffer": 6, "steps": 0})()
    small = sa.arm_config("tis_token", "small", 1, "/tmp/x", None, args)
    large = sa.arm_config("tis_token", "large", 1, "/tmp/x", None, args)
    assert small.data.buffer_groups == small.learner.global_batch_groups
    assert large.data.buffer_groups == 6 * large.learner.global_batch_groups
    assert large.loss == small.loss and large.run.seed == 1 and large.run.name == "large-tis_token-s1"


def test_t_interval_closed_form():
    mean, lo, hi = sa.t_interval([1.0, 2.0, 3.0])
    u = 0.975                                      # df 2: t_u = (2u - 1) / sqrt(2u(1 - u)); s = 1
    half = (2 * u - 1) / math.sqrt(2 * u * (1 - u)) / math.sqrt(3)
    assert (mean, lo, hi) == pytest.approx((2.0, 2.0 - half, 2.0 + half), rel=1e-12)
    assert math.isnan(sa.t_interval([0.5])[1]) and sa.t_interval([0.5])[0] == 0.5
    # df 1: t = tan(pi (u - 1/2)) (Cauchy); values 0 and 2: mean 1, s = sqrt(2)
    assert sa.t_interval([0.0, 2.0])[2] == pytest.approx(1 + math.tan(math.pi * 0.475) * math.sqrt(2) / math.sqrt(2))


def test_diff_interval_closed_form():
    # a = 1, 2, 3 and b = 0, 2: d = 1, s_p^2 = (2 * 1 + 1 * 2) / 3, df 3
    d, lo, hi = sa.diff_interval([1.0, 2.0, 3.0], [0.0, 2.0])
    half = 3.1824463052837078 * math.sqrt(4 / 3) * math.sqrt(1 / 3 + 1 / 2)
    assert (d, lo, hi) == pytest.approx((1.0, 1.0 - half, 1.0 + half), rel=1e-12)
    assert math.isnan(sa.diff_interval([1.0], [0.0, 2.0])[1]) and sa.diff_interval([1.0], [0.0, 2.0])[0] == 0.0


def test_time_to_threshold_and_histogram():
    t = np.arange(6) * 10.0
    r = np.array([0.1, 0.9, 0.9, 0.6, 0.9, 0.9])
    # trailing 3-step means: nan nan .633 .8 .8 .8
    assert sa.time_to_threshold(t, r, 0.7) == 30.0
    assert math.isnan(sa.time_to_threshold(t, r, 0.95))
    assert sa.staleness_hist([0, 0, 1, 5, 7], bins=4) == [0.4, 0.2, 0.0, 0.4]


def write_run(folder: pathlib.Path, rewards, staleness, t0=1000.0, done=True):
    (folder / "metrics").mkdir(parents=True)
    (folder / "trajectories").mkdir()
    n = len(rewards)
    pd.DataFrame({"step": range(n), "reward_mean": rewards, "wall_time": t0 + 5.0 + 2.0 * np.arange(n)}).to_parquet(
        folder / "metrics" / f"part-000000-00000000-{n - 1:08d}.parquet")
    pd.DataFrame({"staleness": staleness, "reward": np.arange(len(staleness)) / 10, "prompt_len": 5,
                  "gen_version": np.arange(len(staleness))}).to_parquet(
        folder / "trajectories" / "part-000000-00000000-00000000.parquet")
    events = [{"time": t0, "kind": "start"}] + ([{"time": t0 + 99, "kind": "summary"}] if done else [])
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_study_table_on_synthetic_run_folders(tmp_path):
    finals = [0.5, 0.6, 0.8]
    for seed, f in enumerate(finals):   # 8 steps: the last quarter is the last 2
        write_run(tmp_path / "runs" / f"large-none-s{seed}", [0.0] * 5 + [f, f, f], [0, 1, 2, 2, 3])
    write_run(tmp_path / "runs" / "small-m2po-s0", [0.2] * 8, [0, 0, 1])
    (tmp_path / "runs" / "not-a-cell").mkdir()
    write_run(tmp_path / "runs" / "large-bypass-s0", [0.9] * 8, [0], done=False)   # still running
    cells = sa.collect(str(tmp_path), threshold=0.55)
    assert sorted(cells) == [("large", "none"), ("small", "m2po")]
    s = sa.summarise(cells)
    row = s["large"]["none"]
    mean, sd = np.mean(finals), np.std(finals, ddof=1)
    half = 0.95 / math.sqrt(2 * 0.975 * 0.025) * sd / math.sqrt(3)
    assert row["reward_final"] == pytest.approx((mean, mean - half, mean + half), rel=1e-12)
    assert row["reward_first"] == 0.0 and row["seeds"] == 3
    # 8 steps: versions [4, 6) -> only the trajectory of version 4 (of 0..4), reward 0.4
    assert row["reward_mid_versions"][0] == pytest.approx(0.4)
    assert row["reward_mid_versions_minus_none"][0] == pytest.approx(0.0)
    # the 3-step mean first reaches 0.55 at the last step (seeds 0.6 and 0.8 only): 5 + 2 * 7 s
    assert row["time_to_threshold_s"] == 19.0 and row["reached_threshold"] == 2
    assert row["staleness_mean"] == pytest.approx(1.6) and row["staleness_max"] == 3
    assert row["staleness_hist"][:4] == pytest.approx([0.2, 0.2, 0.4, 0.2])
    assert s["small"]["m2po"]["reward_final"][0] == pytest.approx(0.2)
    assert math.isnan(s["small"]["m2po"]["reward_final_minus_none"][0])     # no none arm at small
    text = sa.table(s, 0.55)
    assert "0.633 [" in text and "19 (2/3)" in text
    write_run(tmp_path / "runs" / "small-none-s0", [0.0] * 5 + [0.9] * 3, [0])
    write_run(tmp_path / "runs" / "small-none-s1", [0.0] * 5 + [0.7] * 3, [0])
    effect = sa.level_effect(sa.collect(str(tmp_path), threshold=0.55))
    # a = .5 .6 .8 (var 7/300), b = .9 .7 (var .02): d = 19/30 - .8, s_p^2 = (2 * 7/300 + .02) / 3, df 3
    half = 3.1824463052837078 * math.sqrt((2 * 7 / 300 + 0.02) / 3) * math.sqrt(1 / 3 + 1 / 2)
    assert effect["none"] == pytest.approx((19 / 30 - 0.8, 19 / 30 - 0.8 - half, 19 / 30 - 0.8 + half), rel=1e-9)
    assert list(effect) == ["none"]
    md = sa.markdown(s, 0.55).splitlines()
    assert len(md) == 2 + 2 and md[2].startswith("| large | none | 3 | 0.633 [") and md[2].endswith("| 20 20 40 20 |")
    sa.figure(cells, str(tmp_path / "fig.png"), 0.55)
    assert (tmp_path / "fig.png").stat().st_size > 5000


def test_schedule_runs_every_cell_once_and_parse_cell_inverts_names():
    plan = sa.schedule(list(sa.ARMS), list(sa.LEVELS), [0, 1, 2])
    assert sorted(plan) == sorted((lv, a, s) for lv in sa.LEVELS for a in sa.ARMS for s in (0, 1, 2))
    assert plan[0][1] != plan[2 * len(sa.ARMS)][1]          # the arm order rotates per seed
    for lv, a, s in plan:
        assert sa.parse_cell(f"{lv}-{a}-s{s}") == (lv, a, s)
    assert sa.parse_cell("warm") is None and sa.parse_cell("large-nope-s1") is None


def test_a_rerun_keeps_finished_cells_reruns_incomplete_ones_and_counts_the_grid(tmp_path):
    work = str(tmp_path)
    write_run(tmp_path / "runs" / "large-vtrace-s0", [0.5] * 8, [3])
    write_run(tmp_path / "runs" / "large-m2po-s0", [0.5] * 8, [3], done=False)   # killed mid-run
    plan = sa.schedule(["vtrace", "m2po"], ["small", "large"], [0])
    todo, kept = sa.pending(plan, work)
    assert kept == [("large", "vtrace", 0)]
    assert sorted(todo) == [("large", "m2po", 0), ("small", "m2po", 0), ("small", "vtrace", 0)]
    # the unfinished folder is out of the runs (so the rerun starts fresh), kept aside
    assert sa.cell_state(work, "large-m2po-s0") == "absent"
    assert [p.name.rpartition("-")[0] for p in (tmp_path / "incomplete").iterdir()] == ["large-m2po-s0"]
    assert sa.pending(plan, work) == (todo, kept)               # nothing moves twice
    grid = sa.grid_status(sa.collect(work, 0.5), ["vtrace", "m2po"], ["small", "large"], [0, 1])
    assert grid["cells"] == 8 and grid["finished"] == 1
    assert len(grid["missing"]) == 7 and "large-vtrace-s0" not in grid["missing"]
    # a fresh machine: no run folders, only the cell JSONs a collect wrote
    cells_dir = str(tmp_path / "cells")
    first = sa.collect(work, 0.5, cells_dir)
    fresh = str(tmp_path / "fresh")
    assert sa.pending(plan, fresh, cells_dir)[1] == kept
    again = sa.collect(fresh, 0.5, cells_dir)
    assert again.keys() == first.keys() and all(json.dumps(again[k]) == json.dumps(first[k]) for k in first)  # NaN too
    assert again[("large", "vtrace")][0]["time_to_threshold_s"] == 9.0   # 5 + 2 * 2 s
    assert math.isnan(sa.collect(fresh, 0.6, cells_dir)[("large", "vtrace")][0]["time_to_threshold_s"])


def test_minus_none_paired_by_seed_is_the_t_interval_of_the_same_seed_differences():
    def run(cell, final):
        return {"cell": cell, "reward_final": final, "reward_mid_versions": final, "reward_gain_same_len": 0.0,
                "reward_first": 0.0, "time_to_threshold_s": math.nan, "staleness_hist": [1.0],
                "staleness_mean": 1.0, "staleness_max": 1, "wall_s": 1.0}
    cells = {("large", "none"): [run(f"large-none-s{i}", f) for i, f in enumerate([0.5, 0.6, 0.8])],
             ("large", "vtrace"): [run("large-vtrace-s2", 0.9), run("large-vtrace-s0", 0.6)]}
    row = sa.summarise(cells)["large"]["vtrace"]
    # d = 0.6 - 0.5, 0.9 - 0.8 (seeds 0 and 2; seed 1 has no vtrace run): mean 0.1, s = 0
    assert row["reward_final_minus_none_paired"] == pytest.approx((0.1, 0.1, 0.1))
    assert row["reward_final_minus_none"][0] == pytest.approx(0.75 - 19 / 30)    # unpaired: all seeds
