"""The manager's heartbeats with real Ray actors: `manager.heartbeat_timeout_s` decides when a slow
rollout is dead, `manager.startup_grace_s` covers a first compile (stats blocked behind the
worker's lock), and a rollout killed by PID is replaced under a new id up to
`manager.max_restarts`, after which the manager reports the fleet as not restartable."""
import os
import signal
import time

import pytest
import ray

from laminar_jax.config import load_config
from laminar_jax.manager.manager import RolloutManager
from laminar_jax.runtime import liveness
from tests.laminar_jax.manager.test_manager import data_actor


class SlowRollout:
    """stats() answers at once `fast_calls` times, then only after `delay_s`; version -1 means
    "still compiling"."""

    def __init__(self, rid, *, delay_s=0.0, fast_calls=0, version=0):
        self.rid, self.delay_s, self.fast, self.version = rid, delay_s, fast_calls, version

    def stats(self):
        if self.fast > 0:
            self.fast -= 1
        else:
            time.sleep(self.delay_s)
        return {"id": self.rid, "failed": None, "version": self.version, "kv_used": 0.1, "kv_peak": 0.1,
                "num_running": 0, "num_waiting": 0}

    def pid(self):
        return os.getpid()

    def run(self):
        return None


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False)   # never join another process's cluster
    yield
    ray.shutdown()


def _manager(rollouts, spawn=None, **keys):
    keys = {"manager.heartbeat_s": 0.2, "manager.repack": False, **keys}
    cfg = load_config("configs/default.yaml", [f"{k}={v}" for k, v in keys.items()])
    return RolloutManager(cfg, rollouts, data_actor(), spawn=spawn)


def _rounds(m, seconds):
    end = time.time() + seconds
    while time.time() < end:
        m.round()


def _actor(rid, **kw):
    """A started actor (its process is up), so the timings below are the heartbeat's alone."""
    handle = ray.remote(SlowRollout).options(num_cpus=0, max_concurrency=2).remote(rid, **kw)
    ray.get(handle.pid.remote(), timeout=300)
    return handle


@pytest.mark.parametrize("timeout_s, dead", [(0.5, True), (8.0, False)])
def test_heartbeat_timeout_s_decides_when_a_slow_rollout_is_dead(local_ray, timeout_s, dead):
    m = _manager({"a": _actor("a", delay_s=3.0, fast_calls=1)}, **{"manager.heartbeat_timeout_s": timeout_s})
    _rounds(m, 2.5)
    assert ("a" not in m.rollouts) == dead
    if dead:
        (event,) = [e for e in m.drain_events() if e["kind"] == "rollout_dead"]
        assert "manager.heartbeat_timeout_s=0.5" in event["reason"]


@pytest.mark.parametrize("grace_s, dead", [(0.5, True), (30.0, False)])
def test_a_compiling_rollout_gets_startup_grace_s(local_ray, grace_s, dead):
    # never answered yet and no weights: its first compile holds the lock
    m = _manager({"c": _actor("c", delay_s=2.0, version=-1)},
                 **{"manager.heartbeat_timeout_s": 0.5, "manager.startup_grace_s": grace_s})
    _rounds(m, 1.5)
    assert ("c" not in m.rollouts) == dead
    assert m.report()["starting"] == ([] if dead else ["c"])


class Spawner:
    def __init__(self):
        self.calls = []

    def __call__(self, index, restart):
        rid = f"r{index}.{restart}"
        self.calls.append(rid)
        return rid, _actor(rid)


def test_a_rollout_killed_by_pid_is_replaced_up_to_max_restarts(local_ray):
    spawn = Spawner()
    first = _actor("r0")
    m = _manager({"r0": first}, spawn=spawn, **{"manager.max_restarts": 1})
    _rounds(m, 0.5)
    os.kill(ray.get(first.pid.remote()), signal.SIGKILL)
    _rounds(m, 2.0)
    assert spawn.calls == ["r0.1"] and list(m.rollouts) == ["r0.1"]
    assert m.report()["restartable"] is False
    os.kill(ray.get(m.rollouts["r0.1"].pid.remote()), signal.SIGKILL)
    _rounds(m, 2.0)
    assert spawn.calls == ["r0.1"] and m.rollouts == {}
    kinds = [e["kind"] for e in m.drain_events()]
    assert kinds.count("rollout_dead") == 2 and kinds.count("rollout_restarted") == 1
    assert kinds.count("rollout_not_restarted") == 1
    # the driver's liveness check turns this into an immediate, named error
    data = m.data.liveness()
    why = liveness.verdict(data, m.report(), 0.5, cfg=m.cfg, step=3)
    assert why is not None and why.startswith("no rollout is alive and none can be restarted")
    assert "manager.max_restarts=1" in why
