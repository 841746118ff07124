"""Resume after a real crash: the learner actor is killed mid-run; the rerun resumes from the last
committed checkpoint with the same version and cursor, every step and trajectory logged once,
an exact ledger, and no weight store left behind.

Repack is tested deterministically without Ray, with real engines, workers and manager
(tests/rollout/test_worker_repack.py): on a Ray run, whether two rollouts ramp down in the same
manager round depends on timing, so a Ray test of it could not be made reliable."""
import os
import time

import pytest
import ray

from laminar_jax.analysis import load_run
from laminar_jax.runtime import driver, run_folder
from tests.laminar_jax.runtime.runtime_fixtures import base_config


def test_learner_killed_then_resumed_logs_each_step_and_trajectory_once(cluster, warm_model, tmp_path):
    overrides = {"run.steps": 7, "run.checkpoint_every": 2, "run.checkpoint_every_s": 0}
    cfg = base_config(str(tmp_path), "resume", warm_model, **overrides)
    run_dir = tmp_path / "resume"
    killed = {}

    def kill_after_v4_commits(step, fleet, metrics):
        if step != 4:  # version 5 is out; the v4 save started one step ago
            return
        deadline = time.time() + 60
        while not (run_dir / "checkpoints" / "4").is_dir() and time.time() < deadline:
            time.sleep(0.1)
        killed["store"] = ray.get(fleet.learner.weight_store.remote()).root
        ray.kill(fleet.learner, no_restart=True)  # a real crash: no close, no final checkpoint

    with pytest.raises(ray.exceptions.RayActorError):
        driver.run(cfg, quiet=True, on_step=kill_after_v4_commits)
    assert not os.path.exists(killed["store"]), "the dead learner's weight store was left in /dev/shm"
    crashed = load_run(run_dir)
    assert list(crashed.metrics.step) == [0, 1, 2, 3, 4]           # what the crash kept
    assert set(crashed.events[crashed.events.kind == "checkpoint"].version) == {2, 4}
    assert run_folder.checkpoints(str(run_dir))[-1] == 4

    # the printed resume command, run as printed, with one more step (run.steps may change)
    hint = run_folder.resume_hint(cfg, [f"{k}={v}" for k, v in overrides.items()])
    assert "checkpoint v4" in hint and hint.splitlines()[-1].strip().startswith("laminar train")
    args = hint.splitlines()[-1].split()[2:]
    resumed_cfg = base_config(str(tmp_path), "resume", warm_model,
                              **{**dict(a.split("=", 1) for a in args), "run.steps": 8})
    second = driver.run(resumed_cfg, quiet=True)
    assert second["steps"] == 4                                      # steps 4..7 redone / new
    run = load_run(second["run_dir"])
    assert list(run.metrics.step) == list(range(8))
    assert list(run.metrics.version) == list(range(1, 9))
    traj = run.trajectories
    groups, size = cfg.learner.global_batch_groups, cfg.data.group_size
    assert len(traj) == 8 * groups * size
    assert traj.trajectory_id.is_unique, "a trajectory was logged twice across the crash"
    assert traj.groupby("group_id").size().eq(size).all(), "a group was consumed twice"
    assert (traj.step == traj.learner_version).all()
    assert list(run.events[run.events.kind == "resumed"].version) == [4]
    committed = run.events[run.events.kind == "checkpoint"]
    assert sorted(committed.version) == [2, 4, 6, 8] and (committed.save_s >= 0).all()
    acc = second["accounting"]
    assert acc["unaccounted"] == 0 and acc["consumed"] == 8 * groups
    assert acc["duplicates"] == 0
    assert 0.0 <= second["exact_rate_first"] <= 1.0 and "exact_rate" in run.metrics

