"""`learner.hosts: 2` through `laminar train` (runtime/learner_group.py): two learner processes,
one per Ray node of the test cluster, joined by jax.distributed into one mesh (1 fake device
each), learn countdown; a learner host killed mid-run stops the run with an error naming it
(no hang in a collective), and the rerun resumes from the last checkpoint -- on one host, so the
2-host checkpoint restores onto a different host count. Bad input fails before any worker."""
import json

import pytest
import ray

from laminar_jax.analysis import load_run
from laminar_jax.config_loader import ConfigError
from laminar_jax.runtime import driver, learner_group, run_folder
from laminar_jax.runtime.cluster import ClusterError
from tests.laminar_jax.runtime.runtime_fixtures import countdown_config

TWO_HOSTS = {"learner.hosts": 2, "mesh.data": 2}


def _actors() -> int:
    from ray._private import state   # GCS's table (the test cluster runs no dashboard)
    return len(state.actors(actor_state_name="ALIVE"))


def test_hosts_the_cluster_cannot_place_or_a_mesh_that_does_not_split_fail_before_any_worker(cluster, tmp_path):
    before = _actors()
    model = str(tmp_path / "never-read")   # the checks come before the model is read
    # the test cluster: 2 nodes x 8 logical CPUs, one CPU bundle per CPU learner host
    cfg = countdown_config(str(tmp_path), "too_many", model, **{"learner.hosts": 32, "mesh.data": 32})
    with pytest.raises(ClusterError, match=r"learner.hosts=32: .* can place only 16"):
        driver.run(cfg, quiet=True)
    cfg = countdown_config(str(tmp_path), "odd", model, **{"learner.hosts": 2, "mesh.data": 3})
    with pytest.raises(ConfigError, match=r"mesh.data=3 .* learner.hosts=2"):
        driver.run(cfg, quiet=True)
    cfg = countdown_config(str(tmp_path), "tp", model, **{"learner.hosts": 2, "mesh.tensor": 2})
    with pytest.raises(ConfigError, match=r"mesh.tensor.*learner.hosts=2"):
        learner_group.devices_per_host(cfg)
    assert _actors() == before, "an actor was started before the error"


def _checkpoints(run_dir) -> set:
    path = run_dir / "events.jsonl"
    return {int(e["version"]) for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == "checkpoint"}


@pytest.mark.slow
def test_two_host_train_learns_then_a_dead_host_stops_it_and_one_host_resumes(cluster, countdown_model, tmp_path):
    cfg = countdown_config(str(tmp_path), "two_hosts", countdown_model,
                           **TWO_HOSTS, **{"run.checkpoint_every": 4, "run.checkpoint_every_s": 0})
    summary = driver.run(cfg, quiet=True)
    run = load_run(summary["run_dir"])
    m = run.metrics
    assert len(m) == cfg.run.steps and (m["learner/hosts"] == 2).all()
    assert summary["accounting"]["unaccounted"] == 0
    k = max(1, len(m) // 4)
    assert m.reward_mean.iloc[-k:].mean() > m.reward_mean.iloc[:k].mean() + 0.05, m.reward_mean.tolist()

    # a dead host: the step stops with an error naming it, within the liveness poll
    cfg = countdown_config(str(tmp_path), "fault", countdown_model,
                           **TWO_HOSTS, **{"run.steps": 8, "run.checkpoint_every": 2, "run.checkpoint_every_s": 0})
    run_dir = tmp_path / "fault"
    killed = {}

    def kill_a_follower(step, fleet, metrics):
        if step >= 2 and 2 in _checkpoints(run_dir) and not killed:
            killed["step"] = step
            ray.kill(fleet.learner_hosts[1], no_restart=True)
    with pytest.raises(Exception, match=r"learner host \d of learner.hosts=2 is dead|learner host died"):
        driver.run(cfg, quiet=True, on_step=kill_a_follower)
    latest = run_folder.checkpoints(str(run_dir))[-1]
    assert latest >= 2
    # the rerun resumes from that checkpoint on ONE host (2 -> 1) and finishes
    resumed = countdown_config(str(tmp_path), "fault", countdown_model,
                               **{"mesh.data": 2, "run.steps": latest + 2, "run.checkpoint_every": 2,
                                  "run.checkpoint_every_s": 0})
    second = driver.run(resumed, quiet=True)
    run = load_run(second["run_dir"])
    assert list(run.events[run.events.kind == "resumed"].version) == [latest]
    assert list(run.metrics.version) == list(range(1, latest + 3))
    assert (run.metrics["learner/hosts"].iloc[latest:] == 1).all()
    assert run.trajectories.trajectory_id.is_unique
