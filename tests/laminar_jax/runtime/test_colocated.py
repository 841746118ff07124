"""`run.colocate` through `laminar train`'s path (`driver.run`): the learner and one JAX rollout in
this process, without Ray, weights in memory (`runtime.colocated`).

A colocated sync run is the actors' sync run moved into one process: the same data actor,
rollout worker and learner, the same seeds. So it must make the same trajectories, step by step,
and the same learner updates. A rollout that dies ends the run with an error naming it, within
seconds, instead of the learner's 15-minute stall."""
import threading
import time

import numpy as np
import pytest

from laminar_jax.analysis import load_run
from laminar_jax.runtime import cluster as cluster_mod
from laminar_jax.runtime import driver
from laminar_jax.runtime.colocated import POLL_S, Colocated
from laminar_jax.runtime.liveness import LivenessError
from tests.laminar_jax.runtime.runtime_fixtures import base_config

SYNC = {"manager.mode": "sync", "rollout.num_rollouts": 1, "run.steps": 3}
SAME = ["trajectory_id", "prompt_id", "reward", "response_len", "finish_reason", "gen_version", "staleness",
        "learner_version"]


def _no_ray(monkeypatch):
    def refuse(cfg):
        raise AssertionError("a colocated run started Ray")
    monkeypatch.setattr(cluster_mod, "start", refuse)


def test_a_colocated_sync_run_equals_the_actors_sync_run(cluster, warm_model, tmp_path, monkeypatch):
    actors = driver.run(base_config(str(tmp_path), "actors", warm_model, **SYNC), quiet=True)
    _no_ray(monkeypatch)
    seen = []
    colocated = driver.run(base_config(str(tmp_path), "colocated", warm_model, **SYNC, **{"run.colocate": "true"}),
                           quiet=True, on_step=lambda step, run, m: seen.append(
                               (type(run), [t.name for t in threading.enumerate()])))
    assert [kind for kind, _ in seen] == [Colocated] * SYNC["run.steps"]
    assert all("rollout-rollout-0" in names for _, names in seen), "the rollout is a thread of this process"
    a, c = load_run(actors["run_dir"]), load_run(colocated["run_dir"])
    ta, tc = (r.trajectories.sort_values("trajectory_id").reset_index(drop=True)[SAME] for r in (a, c))
    assert len(tc) == SYNC["run.steps"] * 4 * 8
    assert (tc.staleness == 0).all()
    assert ta.equals(tc), "the same trajectories, step by step"
    for key in ("reward_mean", "loss/loss", "loss/grad_norm"):
        np.testing.assert_allclose(c.metrics[key], a.metrics[key], rtol=1e-4, err_msg=key)
    kinds = set(c.events.kind)
    assert {"pull", "learner_init", "checkpoint"} <= kinds and not any(k.startswith("relay") for k in kinds)
    assert colocated["accounting"]["unaccounted"] == 0 and colocated["manager"] is None


def test_a_dead_rollout_ends_a_colocated_run_with_its_error(warm_model, tmp_path, monkeypatch):
    _no_ray(monkeypatch)
    broke = {}

    def break_engine(step, run, m):
        if step == 0:
            def boom():
                raise RuntimeError("engine lost its device")
            run.worker.engine.step = boom
            broke["t"] = time.time()

    cfg = base_config(str(tmp_path), "dies", warm_model, **{**SYNC, "run.steps": 4, "run.colocate": "true"})
    with pytest.raises(LivenessError, match=r"rollout rollout-0 died \(RuntimeError: engine lost its device\)"):
        driver.run(cfg, quiet=True, on_step=break_engine)
    assert time.time() - broke["t"] < 30 * POLL_S


def test_a_colocated_laminar_run_trains_on_what_the_rollout_made_meanwhile(warm_model, tmp_path, monkeypatch):
    """laminar mode in one process: the rollout thread generates its next batch on the version it
    holds while the learner thread updates, so consumed groups are stale by the versions between."""
    _no_ray(monkeypatch)
    cfg = base_config(str(tmp_path), "laminar", warm_model, **{**SYNC, "manager.mode": "laminar", "run.steps": 4,
                                                              "run.colocate": "true"})
    summary = driver.run(cfg, quiet=True)
    traj = load_run(summary["run_dir"]).trajectories
    assert len(traj) == 4 * 4 * 8 and summary["accounting"]["unaccounted"] == 0
    assert (traj.staleness == traj.learner_version - traj.gen_version).all()
    assert traj.staleness.max() >= 1, "the rollout generated while the learner trained"


def test_a_colocated_run_whose_prompts_run_out_stops_saying_so(warm_model, tmp_path, monkeypatch):
    """The Ray driver's liveness verdicts hold here too (`liveness.Watchdog` over the in-process
    data actor, learner and rollout): one pass over 8 prompts feeds 2 steps of 4 groups, not 4."""
    _no_ray(monkeypatch)
    cfg = base_config(str(tmp_path), "exhausted", warm_model, **{**SYNC, "run.steps": 4, "run.colocate": "true",
                                                                "data.num_prompts": 8, "data.max_epochs": 1})
    t0 = time.time()
    with pytest.raises(LivenessError, match=r"prompts exhausted: data.max_epochs=1 passes over 8 prompts ended "
                                            r"at step 2"):
        driver.run(cfg, quiet=True)
    assert time.time() - t0 < 60


def test_a_colocated_run_resumes_from_its_checkpoint(warm_model, tmp_path, monkeypatch):
    """The learner restores its checkpoint and the in-process data actor its pool and buffer
    (`rpc.call` on a plain object): a second launch with more steps goes on from version 2."""
    _no_ray(monkeypatch)
    over = {**SYNC, "run.steps": 2, "run.colocate": "true"}
    driver.run(base_config(str(tmp_path), "resumed", warm_model, **over), quiet=True)
    summary = driver.run(base_config(str(tmp_path), "resumed", warm_model, **{**over, "run.steps": 4}), quiet=True)
    run = load_run(summary["run_dir"])
    assert run.metrics.sort_values("step").version.tolist() == [1, 2, 3, 4]
    assert sorted(run.trajectories.learner_version.unique()) == [0, 1, 2, 3]
    assert run.trajectories.trajectory_id.is_unique and len(run.trajectories) == 4 * 4 * 8
    resumed = run.events[run.events.kind == "resumed"]
    assert resumed.version.tolist() == [2]
