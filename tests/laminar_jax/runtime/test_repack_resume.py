"""Repack on a long-tail run (moved trajectories finish on their version with a correct
continuation) and resume from a checkpoint (same version and cursor, no group lost or repeated)."""
import dataclasses

import numpy as np
import pandas as pd

from laminar_jax.analysis import load_run
from laminar_jax.runtime import driver
from tests.laminar_jax.runtime.runtime_fixtures import base_config


def test_repack_moves_keep_one_version(cluster, warm_model, tmp_path):
    # countdown prompts on the arithmetic model: responses run long or stop early -> a long tail
    cfg = base_config(str(tmp_path), "repack", warm_model, **{
        "rollout.num_rollouts": 2, "rollout.max_new_tokens": 64, "learner.max_seq_len": 128,
        "rollout.kv_budget_tokens": 4096, "data.task": "countdown", "data.task_max_n": 23,
        "manager.repack_interval_s": 0.2, "manager.roofline_batch": 64, "run.steps": 8,
        "data.buffer_groups": 4})
    summary = driver.run(cfg, quiet=True)
    run = load_run(summary["run_dir"])
    assert summary["manager"]["moves"] > 0, "no repack happened on the long-tail run"
    moves = run.events[run.events.kind == "repack"]
    assert len(moves) == summary["manager"]["moves"]
    traj = run.trajectories
    moved = traj[traj.repack_count > 0]
    assert len(moved) > 0
    assert not traj.mixed_versions.any()
    assert (traj.gen_version == traj.oldest_version).all(), "a moved trajectory changed version"
    # the continuation is the destination's: a moved trajectory is finished by another rollout
    # than any issuing one would be only if the repack event names it as destination
    assert set(moved.rollout_id) <= set(moves.destination)
    assert (moved.finish_reason.isin(["stop", "length"])).all()


def test_resume_continues_version_and_cursor(cluster, warm_model, tmp_path):
    cfg = base_config(str(tmp_path), "resume", warm_model, **{"run.steps": 4, "run.checkpoint_every": 2})
    first = driver.run(cfg, quiet=True)
    before = load_run(first["run_dir"])
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
