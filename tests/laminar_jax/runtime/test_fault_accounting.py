"""Fault isolation and the ledger: a rollout killed mid-run costs only its work in progress; its
groups are re-issued on the same version or re-queued, nothing is lost or counted twice, and the
manager replaces it with a new rollout (manager.max_restarts) that delivers groups of its own."""
import ray

from laminar_jax.analysis import load_run
from laminar_jax.runtime import driver
from tests.laminar_jax.runtime.runtime_fixtures import base_config


def ledger_holds(acc):
    assert acc["unaccounted"] == 0
    assert acc["issued"] == (acc["consumed"] + acc["buffered"] + acc["in_flight"] + acc["requeued"]
                             + acc["dropped"] + acc["rejected"] - acc["double_held"])


def test_killed_rollout_loses_nothing(cluster, warm_model, tmp_path):
    cfg = base_config(str(tmp_path), "kill", warm_model, **{"rollout.num_rollouts": 3, "run.steps": 8,
                                                            "rollout.max_new_tokens": 12})
    killed = {}

    def kill_one(step, fleet, metrics):
        ledger_holds(ray.get(fleet.data.accounting.remote()))
        if step == 2:
            killed["id"] = "rollout-1"
            ray.kill(fleet.workers["rollout-1"], no_restart=True)

    summary = driver.run(cfg, quiet=True, on_step=kill_one)
    run = load_run(summary["run_dir"])
    ledger_holds(summary["accounting"])
    assert summary["manager"]["dead"] == 1
    dead = run.events[run.events.kind == "rollout_dead"]
    assert list(dead.rollout) == ["rollout-1"]
    assert int(dead.reissued.iloc[0]) + int(dead.requeued.iloc[0]) == int(dead.groups.iloc[0])
    traj = run.trajectories
    # every consumed group is whole and consumed once, whatever happened to its rollout
    assert traj.groupby("group_id").size().eq(cfg.data.group_size).all()
    assert len(traj) == cfg.run.steps * cfg.learner.global_batch_groups * cfg.data.group_size
    (restarted,) = run.events[run.events.kind == "rollout_restarted"].itertuples()
    assert (restarted.replaces, restarted.rollout) == ("rollout-1", "rollout-1.r1")
    assert summary["manager"]["restarts"] == 1
    # the replacement came up (it loaded weights) and the fleet is whole again
    pulls = run.events[(run.events.kind == "pull")]
    assert (pulls.rollout == "rollout-1.r1").any()
    assert run.metrics["live_rollouts"].iloc[-1] == 3
