"""Bounded staleness by construction: `max_staleness` gates what laminar / partial rollouts take
(`modes.bounded_issue_limit`, AReaL's rule) and the buffer's staleness filter drops the groups
that finished too far out of order (the runtime's `ExperienceBuffer.drop_stale`)."""
import random

import pytest

from laminar_jax.data.buffer import ExperienceBuffer
from laminar_jax.sim.buffer import SimBuffer
from laminar_jax.sim.engine import Sim
from tests.laminar_jax.sim.test_sim_backpressure import _group
from tests.laminar_jax.sim.test_sim_engine import tiny

# variable lengths (so groups finish out of order), 4 rollouts, a learner slower than they are
VARIED = {"workload.response": {"kind": "lognormal", "median": 600, "sigma": 0.8,
                                "maximum": 6000},
          "model.trainer.seconds_per_token": 1.5e-3, "run.warmup_steps": 4,
          "run.measure_steps": 10}


def _run(mode, bound, relays=True, **over):
    name = "lam" if mode == "laminar" else "areal"
    system = {"name": name, "mode": mode, "max_concurrency": 16, "max_staleness": bound}
    if mode == "laminar":
        system["relays"] = relays
    cfg = tiny([system], [{"system": name, "accelerators": 5, "train": 1, "rollout": 4}],
               **{**VARIED, **over})
    return Sim(cfg, cfg.cells[0]).run()


@pytest.mark.parametrize("mode", ["laminar", "partial"])
def test_max_staleness_bounds_staleness_by_construction(mode):
    free = _run(mode, None)
    assert free.summary()["staleness_max"] > 2          # the fleet runs ahead when ungated
    issued = {}
    for bound in (0, 2):
        sim = _run(mode, bound)
        s = sim.summary()
        stale = [v - sim.ts.gen_version[i] for i, v, _ in sim.consumed]
        assert max(stale) <= bound, (mode, bound)
        # the gate's invariant: what was issued and not dropped fits the versions made so far
        live = sim.issued - sim.buffer.dropped_trajectories
        assert live <= (sim.version + bound + 1) * sim.B, (mode, bound)
        # dropped groups are never consumed
        dropped = {i for rec in sim.buffer.dropped_stale for i in sim.ts.group_members[rec.group]}
        assert not dropped & set(sim.consumed_ids)
        assert s["dropped_stale_groups"] == len(sim.buffer.dropped_stale)
        issued[bound] = sim.issued
    assert issued[0] < issued[2] < free.issued                 # the setting changes the run


def test_gate_leaves_a_laminar_run_steady_and_fed():
    """The bound throttles producers without starving the learner: steady, learner busy."""
    over = {"data.buffer_groups": 4}
    s = _run("laminar", 2, **over).summary()
    assert s["steady"] and s["staleness_max"] <= 2
    assert s["learner_idle_frac"] < 0.2
    free = _run("laminar", None, **over).summary()
    assert not free["steady"] and free["staleness_drift"] > 1.0


def test_sim_staleness_filter_matches_the_runtime_buffer():
    rng = random.Random(1)
    real = ExperienceBuffer(1000, max_staleness=2)
    sim = SimBuffer(1000, "block", max_staleness=2, group_size=2)
    for g in range(200):
        v = rng.randrange(12)
        assert real.put(_group(str(g), v))
        sim.deliver(sim.record(g, v), 0)
        if rng.random() < 0.1:
            version = rng.randrange(12)
            assert sim.drop_stale(version) == real.drop_stale(version)
            assert [int(x) for x in real.group_ids()] == [r.group for r in sim.groups]
    assert sim.dropped_trajectories == 2 * len(sim.dropped_stale)
    assert real.accounting()["dropped_stale"] == len(sim.dropped_stale)


def test_gate_with_a_global_sync_barrier():
    """relays off: every publish waits for all rollouts; gated ones count as waiting, so the
    barrier still completes, and the bound holds."""
    sim = _run("laminar", 1, relays=False)
    assert max(v - sim.ts.gen_version[i] for i, v, _ in sim.consumed) <= 1
    assert len(sim.steps) == 14
