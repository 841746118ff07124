"""Resume after a real crash: the learner actor is killed mid-run; the rerun resumes from the last
committed checkpoint with the same version and cursor, every step and trajectory logged once,
an exact ledger, and no weight store left behind.

Repack is tested deterministically without Ray, with real engines, workers and manager
(tests/rollout/test_worker_repack.py): on a Ray run, whether two rollouts ramp down in the same
manager round depends on timing, so a Ray test of it could not be made reliable."""
import json
import os

import pytest
import ray

from laminar_jax.analysis import load_run
from laminar_jax.runtime import driver, run_folder
from tests.laminar_jax.runtime.runtime_fixtures import base_config


def _checkpoint_events(run_dir) -> set:
    path = run_dir / "events.jsonl"
    return {int(e["version"]) for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == "checkpoint"}


def _rows_on_disk_before_each_save(run_dir) -> None:
    """Checkpoint v covers steps 0..v-1: their metrics rows were written (a part file's mtime)
    before the save started (commit time - save_s), so no crash can lose a step a checkpoint covers."""
    from laminar_jax.runfiles import METRICS_DIR, parts
    stored = [(first, last, os.stat(path).st_mtime) for _, first, last, path in parts(run_dir / METRICS_DIR)]
    for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()):
        if e["kind"] != "checkpoint":
            continue
        save_start = e["t"] - e["save_s"]
        step = int(e["version"]) - 1
        written = [mtime for first, last, mtime in stored if first <= step <= last]
        assert written and written[0] <= save_start, (e["version"], written, save_start)


def test_learner_killed_then_resumed_logs_each_step_and_trajectory_once(cluster, warm_model, tmp_path):
    overrides = {"run.steps": 8, "run.checkpoint_every": 2, "run.checkpoint_every_s": 0}
    cfg = base_config(str(tmp_path), "resume", warm_model, **overrides)
    run_dir = tmp_path / "resume"
    killed = {}

    def kill_once_v4_is_committed(step, fleet, metrics):
        if step < 4 or 4 not in _checkpoint_events(run_dir):
            return
        killed["store"] = ray.get(fleet.learner.weight_store.remote()).root
        killed["step"] = step
        ray.kill(fleet.learner, no_restart=True)  # a real crash: no close, no final checkpoint

    with pytest.raises(ray.exceptions.RayActorError):
        driver.run(cfg, quiet=True, on_step=kill_once_v4_is_committed)
    assert not os.path.exists(killed["store"]), "the dead learner's weight store was left in /dev/shm"
    crashed = load_run(run_dir)
    _rows_on_disk_before_each_save(run_dir)
    assert list(crashed.metrics.step) == list(range(killed["step"] + 1))      # what the crash kept
    latest = run_folder.checkpoints(str(run_dir))[-1]
    logged = _checkpoint_events(run_dir)
    # an event only for a committed save (a save the kill cut short has none)
    assert {2, 4} <= logged <= {2, 4, 6} and max(logged) <= latest

    # the printed resume command, run as printed, with one more step (run.steps may change)
    hint = run_folder.resume_hint(cfg, [f"{k}={v}" for k, v in overrides.items()])
    assert f"checkpoint v{latest}" in hint and hint.splitlines()[-1].strip().startswith("laminar train")
    args = hint.splitlines()[-1].split()[2:]
    resumed_cfg = base_config(str(tmp_path), "resume", warm_model,
                              **{**dict(a.split("=", 1) for a in args), "run.steps": 9})
    second = driver.run(resumed_cfg, quiet=True)
    assert second["steps"] == 9 - latest                          # the steps after the checkpoint
    run = load_run(second["run_dir"])
    assert list(run.metrics.step) == list(range(9))
    assert list(run.metrics.version) == list(range(1, 10))
    traj = run.trajectories
    groups, size = cfg.learner.global_batch_groups, cfg.data.group_size
    assert len(traj) == 9 * groups * size
    assert traj.trajectory_id.is_unique, "a trajectory was logged twice across the crash"
    assert traj.groupby("group_id").size().eq(size).all(), "a group was consumed twice"
    assert (traj.step == traj.learner_version).all()
    assert list(run.events[run.events.kind == "resumed"].version) == [latest]
    assert 9 in _checkpoint_events(run_dir)
    acc = second["accounting"]
    assert acc["unaccounted"] == 0 and acc["consumed"] == 9 * groups and acc["duplicates"] == 0
    assert 0.0 <= second["exact_rate_first"] <= 1.0 and run.metrics.exact_rate.between(0, 1).all()
