"""Resume from a checkpoint: same version and cursor, no group lost or repeated.

Repack is tested deterministically without Ray, with real engines, workers and manager
(tests/rollout/test_worker_repack.py): on a Ray run, whether two rollouts ramp down in the same
manager round depends on timing, so a Ray test of it could not be made reliable."""
import dataclasses


from laminar_jax.analysis import load_run
from laminar_jax.runtime import driver
from tests.laminar_jax.runtime.runtime_fixtures import base_config


def test_resume_continues_version_and_cursor(cluster, warm_model, tmp_path):
    cfg = base_config(str(tmp_path), "resume", warm_model, **{"run.steps": 4, "run.checkpoint_every": 2})
    first = driver.run(cfg, quiet=True)
    assert list(load_run(first["run_dir"]).metrics.version) == [1, 2, 3, 4]
    assert (tmp_path / "resume" / "checkpoints" / "4").exists()
    cfg2 = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, steps=7))
    second = driver.run(cfg2, quiet=True)
    run = load_run(second["run_dir"])
    assert second["steps"] == 3
    assert list(run.metrics.step) == list(range(7))
    assert list(run.metrics.version) == list(range(1, 8))
    traj = run.trajectories
    assert len(traj) == 7 * cfg.learner.global_batch_groups * cfg.data.group_size
    counts = traj.groupby("group_id").size()
    assert counts.eq(cfg.data.group_size).all(), "a group was consumed twice across the restart"
    resumed = run.events[run.events.kind == "resumed"]
    assert list(resumed.version) == [4]
    acc = second["accounting"]
    assert acc["unaccounted"] == 0 and acc["consumed"] == 7 * cfg.learner.global_batch_groups
