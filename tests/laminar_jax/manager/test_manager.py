"""RolloutManager driven in-process: fake rollouts that report chosen loads and record what the
manager asks of them, and a real in-process DataActor holding the ledger and partial pool.

- repack moves trajectories only between rollouts on the same weight version, hands each moved
  trajectory over with repack_count + 1, and records the new holder in the ledger;
- a refused adoption re-queues the groups (never continued on other weights);
- a dead rollout's groups are re-issued to a live rollout on the version their tokens have when
  every sample is in the partial pool, otherwise re-queued; the ledger stays balanced;
- the plan's inputs: a draining rollout is a ramp-down candidate while its KV is below its batch's
  peak (flat between samples included), never while requests wait; B is capped by a rollout's
  concurrency.
"""
import numpy as np
import ray

from laminar_jax.config import load_config
from laminar_jax.data.records import PartialTrajectory, PromptRow
from laminar_jax.manager.manager import RolloutManager, plan_loads, roofline_batch
from laminar_jax.manager.repack import is_candidate
from laminar_jax.runtime.data_actor import DataActor

GROUP = 2


class FakeRollout:
    def __init__(self, rid, version, *, dead=False, accepts=True):
        self.id, self.version, self.dead, self.accepts = rid, version, dead, accepts
        self.kv, self.running = 0.5, 4
        self.held: tuple[list, list] = ([], [])
        self.released, self.adopted = [], []

    def stats(self):
        if self.dead:
            raise ray.exceptions.RayActorError()
        return {"id": self.id, "failed": None, "version": self.version, "kv_used": self.kv,
                "num_running": self.running}

    def release(self, version):
        self.released.append(version)
        if version != self.version or not self.held[0]:
            return None
        out, self.held = self.held, ([], [])
        return out

    def adopt(self, version, groups, partials):
        self.adopted.append((version, [g.group_id for g in groups], partials))
        return self.accepts and version == self.version


def data_actor():
    rows = [PromptRow(f"q{i}", f"p{i}", "x", {}) for i in range(8)]
    return DataActor(dict(rows=rows, group_size=GROUP, shuffle=False, encode=lambda s: [3, 4]),
                     dict(capacity_groups=16), mode="laminar", global_batch=2, max_staleness=None)


def partial(group, index, rid, versions):
    n = len(versions)
    return PartialTrajectory(group.group_id, index, rid, np.asarray([3, 4]), np.arange(5, 5 + n),
                             -np.ones(n) / 2, -np.ones(n) / 2, np.asarray(versions), group.prompt_id)


def manager(rollouts, data):
    cfg = load_config("configs/default.yaml", ["manager.mode=laminar", "manager.c_max=0.99",
                                               "manager.roofline_batch=64"])
    return RolloutManager(cfg, {r.id: r for r in rollouts}, data)


def test_repack_moves_only_within_a_version_and_updates_the_ledger():
    data = data_actor()
    a, b, c, d = FakeRollout("a", 0), FakeRollout("b", 0), FakeRollout("c", 1), FakeRollout("d", 2)
    (ga,) = data.issue(1, "a", 0)
    (gc,) = data.issue(1, "c", 1)
    a.held = ([ga], [partial(ga, 0, "a", [0, 0]), partial(ga, 1, "a", [0])])
    c.held = ([gc], [partial(gc, 0, "c", [1]), partial(gc, 1, "c", [1, 1])])
    m = manager([a, b, c, d], data)
    m.round()  # first sample: kv_prev = kv_used, nobody is ramping down yet
    assert not any(r.released for r in (a, b, c, d))
    # all ramp down; a and b share version 0, c (v1) and d (v2) are alone on theirs
    a.kv, a.running, b.kv, b.running = 0.1, 2, 0.3, 3
    c.kv, c.running, d.kv, d.running = 0.05, 2, 0.2, 1
    m.round()
    assert a.released == [0] and not b.released
    assert c.released == [] and d.released == [] and c.adopted == [] and d.adopted == []
    ((version, gids, moved),) = b.adopted
    assert version == 0 and gids == [ga.group_id]
    assert [(p.rollout_id, p.repack_count, p.num_tokens) for p in moved] == [("b", 1, 2), ("b", 1, 1)]
    assert [g.group_id for g in data.pool.in_flight("b")] == [ga.group_id]
    assert m.counters["moves"] == 1 and m.counters["moved_trajectories"] == 2
    (event,) = [e for e in m.drain_events() if e["kind"] == "repack"]
    assert (event["source"], event["destination"], event["version"]) == ("a", "b", 0)
    assert data.accounting()["unaccounted"] == 0


def test_refused_adoption_requeues_instead_of_changing_version():
    data = data_actor()
    a, b = FakeRollout("a", 0), FakeRollout("b", 0, accepts=False)  # b moves on to v1 meanwhile
    (ga,) = data.issue(1, "a", 0)
    a.held = ([ga], [partial(ga, 0, "a", [0]), partial(ga, 1, "a", [0])])
    m = manager([a, b], data)
    m.round()
    a.kv, a.running, b.kv, b.running = 0.1, 2, 0.3, 3
    m.round()
    assert len(b.adopted) == 1 and m.counters["failed_moves"] == 1 and m.counters["moves"] == 0
    acc = data.accounting()
    assert acc["requeued"] == 1 and acc["in_flight"] == 0 and acc["unaccounted"] == 0
    again = data.issue(1, "b", 1)
    assert again[0].group_id == ga.group_id and again[0].attempt == 1


def test_dead_rollouts_groups_are_reissued_on_their_version_or_requeued():
    ray_before = ray.is_initialized()
    data = data_actor()
    x, y, z = FakeRollout("x", 0, dead=True), FakeRollout("y", 0), FakeRollout("z", 1)
    g0, g1, g2 = data.issue(3, "x", 0)
    data.update_partials([partial(g0, 0, "x", [0, 0]), partial(g0, 1, "x", [0]),      # whole, v0
                          partial(g1, 0, "x", [1]), partial(g1, 1, "x", [1, 1, 1]),   # whole, v1
                          partial(g2, 0, "x", [0])])                                   # half of it
    m = manager([x, y, z], data)
    m.round()
    assert "x" not in m.rollouts
    assert [(v, gids) for v, gids, _ in y.adopted] == [(0, [g0.group_id])]
    assert [(v, gids) for v, gids, _ in z.adopted] == [(1, [g1.group_id])]
    assert all(p.rollout_id == "y" and p.repack_count == 1 for p in y.adopted[0][2])
    assert m.counters == dict(m.counters, dead=1, reissued_groups=2, requeued_groups=1)
    acc = data.accounting()
    assert acc["requeued"] == 1 and acc["in_flight"] == 2 and acc["unaccounted"] == 0
    holders = {g.group_id: rid for rid in ("y", "z") for g in data.pool.in_flight(rid)}
    assert holders == {g0.group_id: "y", g1.group_id: "z"}
    (event,) = [e for e in m.drain_events() if e["kind"] == "rollout_dead"]
    assert (event["reissued"], event["requeued"]) == (2, 1)
    # failover kills only actors: ray.kill on an in-process rollout auto-started a local Ray
    # (5 s here; 820 s in one CI run, after test_heartbeats' Ray had shut down)
    assert ray.is_initialized() == ray_before


class PeakRollout(FakeRollout):
    """A rollout that reports its batch's KV peak and waiting requests, as RolloutWorker does."""

    def __init__(self, rid, version, *, kv, peak, running, waiting=0):
        super().__init__(rid, version)
        self.kv, self.peak, self.running, self.waiting = kv, peak, running, waiting

    def stats(self):
        return {**super().stats(), "kv_peak": self.peak, "num_waiting": self.waiting}


def held(data, rid, version):
    (g,) = data.issue(1, rid, version)
    return ([g], [partial(g, 0, rid, [version]), partial(g, 1, rid, [version])])


def test_draining_tails_with_flat_kv_between_samples_are_repacked():
    """Two tails of one version whose KV pages did not change since the last round: the old
    sample-to-sample test (C_used < previous C_used) never saw them ramping down; below their
    batch's peak they are, and Algorithm 1 merges them."""
    data = data_actor()
    a = PeakRollout("a", 0, kv=0.02, peak=0.12, running=2)
    b = PeakRollout("b", 0, kv=0.03, peak=0.12, running=3)
    a.held = held(data, "a", 0)
    m = manager([a, b], data)
    m.kv_prev = {"a": 0.02, "b": 0.03}  # the previous round saw the same KV: flat
    m.round()
    assert a.released == [0] and len(b.adopted) == 1 and m.counters["moves"] == 1
    loads = {r.id: r for r in plan_loads({"a": a.stats(), "b": b.stats()}, {})}
    assert loads["a"].kv_prev == 0.12 and loads["a"].kv_used == 0.02


def test_a_rollout_with_waiting_requests_is_not_ramping_down():
    loads = plan_loads({"a": {"version": 0, "kv_used": 0.2, "kv_peak": 0.5, "num_running": 6, "num_waiting": 2},
                        "b": {"version": 0, "kv_used": 0.2, "kv_peak": 0.5, "num_running": 4, "num_waiting": 0},
                        "c": {"version": -1, "kv_used": 0.0, "num_running": 0}}, {})
    assert {r.id: (r.kv_used, r.kv_prev) for r in loads} == {"a": (0.2, 0.2), "b": (0.2, 0.5)}
    assert is_candidate(loads[1], c_max=0.99, roofline_batch=64)
    assert not is_candidate(loads[0], c_max=0.99, roofline_batch=64)
    # without kv_peak (another rollout implementation) the previous sample is C_prev, as before
    (old,) = plan_loads({"a": {"version": 0, "kv_used": 0.2, "num_running": 3}}, {"a": 0.3})
    assert old.kv_prev == 0.3


def test_the_roofline_batch_is_capped_by_one_rollouts_concurrency():
    """B = 64 but an engine runs 8 at once: 5 + 5 trajectories must not be packed onto one rollout
    (the moved ones would wait), 4 + 4 may."""
    cfg = load_config("configs/default.yaml", ["manager.mode=laminar", "manager.roofline_batch=64",
                                               "rollout.max_concurrency=8"])
    assert roofline_batch(cfg) == 8
    for running, moved in ((5, 0), (4, 1)):
        data = data_actor()
        a = PeakRollout("a", 0, kv=0.02, peak=0.1, running=running)
        b = PeakRollout("b", 0, kv=0.03, peak=0.1, running=running)
        a.held = held(data, "a", 0)
        m = RolloutManager(cfg, {"a": a, "b": b}, data)
        m.round()
        assert m.counters["moves"] == moved, running
