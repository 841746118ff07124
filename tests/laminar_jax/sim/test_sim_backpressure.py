"""Back-pressure and bounded staleness (data.buffer_groups / data.buffer_when_full, the runtime's
keys and semantics), caps as errors, relay transit waits, the steady-state check."""
import random

import numpy as np
import pytest

from laminar_jax.data.buffer import ExperienceBuffer
from laminar_jax.data.records import Trajectory
from laminar_jax.sim.buffer import SimBuffer
from laminar_jax.sim.engine import CapReached, Sim
from tests.laminar_jax.sim.test_sim_engine import tiny

LAMINAR = [{"name": "lam", "mode": "laminar", "max_concurrency": 16, "relays": True}]
PARTIAL = [{"name": "areal", "mode": "partial", "max_concurrency": 16}]
ONE = [{"system": "lam", "accelerators": 3, "train": 1, "rollout": 2}]


def _group(gid, version):
    return [Trajectory(gid, f"p-{gid}", i, "r0", [1], [2], [0.0], [0.0], [version], version, 0.0,
                       "stop") for i in range(2)]


@pytest.mark.parametrize("when_full", ["block", "drop_oldest", "drop_stalest"])
def test_sim_buffer_matches_the_runtime_buffer(when_full):
    """The same puts and FIFO takes give the same refusals, evictions and batches."""
    rng = random.Random(0)
    real = ExperienceBuffer(4, eviction=when_full)
    sim = SimBuffer(4, when_full)
    held_real: list = []
    for g in range(300):
        if rng.random() < 0.3:                       # the learner takes 2 groups (FIFO)
            got = real.sample(2, 0)
            recs = sim.take_fifo(2)
            assert (recs is None) == (got == [])
            if recs is not None:
                assert [r.group for r in recs] == [int(x[0].group_id) for x in got]
            # the runtime's rollouts retry their refused groups, oldest first
            while held_real and real.put(_group(*held_real[0])):
                held_real.pop(0)
            sim.retry()
            continue
        v = rng.randrange(10)
        if held_real or not real.put(_group(str(g), v)):
            held_real.append((str(g), v))
        sim.deliver(sim.record(g, v), 0)
        assert [int(x) for x in real.group_ids()] == [r.group for r in sim.groups]
        assert [int(x[0]) for x in held_real] == [r.group for r, _ in sim.held]
    assert real.accounting()["evicted"] == len(sim.evicted)
    if when_full == "block":
        assert not sim.evicted and sim.refused > 0
    else:
        assert sim.evicted and not sim.held


def slow_learner(systems, when_full="block", groups=2, **over):
    """Two fast rollouts, a learner ~4x slower than they generate: rollouts must wait."""
    return tiny(systems, ONE if systems is LAMINAR else
                [{"system": "areal", "accelerators": 3, "train": 1, "rollout": 2}],
                **{"model.trainer.seconds_per_token": 4e-3, "run.warmup_steps": 4,
                   "run.measure_steps": 8, "data.buffer_groups": groups,
                   "data.buffer_when_full": when_full, **over})


@pytest.mark.parametrize("systems", [LAMINAR, PARTIAL], ids=["laminar", "partial"])
def test_block_bounds_generation_and_staleness(systems):
    cap = 2
    blocked = Sim(slow_learner(systems, groups=cap), slow_learner(systems).cells[0]).run()
    free = slow_learner(systems, groups=10_000)
    unbounded = Sim(free, free.cells[0]).run()
    # occupancy never above the capacity; what the rollouts hold is at most their batches
    assert max(s["buffer_groups"] for s in blocked.steps) <= cap
    assert max(s["held_groups"] for s in blocked.steps) > 0
    in_flight = 2 * 16
    consumed = len(blocked.consumed_ids)
    assert blocked.issued <= consumed + cap * 4 + in_flight
    # without back-pressure the rollouts run ahead: more generated, staleness keeps rising
    assert unbounded.issued > 2 * blocked.issued
    sb, su = blocked.summary(), unbounded.summary()
    assert sb["staleness_max"] < su["staleness_max"]
    assert sb["steady"] and not su["steady"]
    assert su["staleness_drift"] > 1.0
    assert sb["throughput"] == pytest.approx(su["throughput"], rel=0.05)   # learner-bound


def test_drop_policies_evict_and_never_consume_the_victims():
    sims = {w: Sim(c, c.cells[0]).run() for w in ("drop_oldest", "drop_stalest")
            for c in [slow_learner(LAMINAR, w)]}
    for w, sim in sims.items():
        ev = sim.buffer.evicted
        assert ev and not sim.buffer.held, w
        dropped = {i for rec in ev for i in sim.ts.group_members[rec.group]}
        assert not dropped & set(sim.consumed_ids), w
        # nothing is held, so the rollouts never wait: fresher data than under block
    block = Sim(slow_learner(LAMINAR), slow_learner(LAMINAR).cells[0]).run()
    assert sims["drop_oldest"].summary()["staleness_mean"] < block.summary()["staleness_mean"]


def test_global_batch_modes_refuse_drop_policies():
    with pytest.raises(ValueError, match="buffer_when_full"):
        tiny([{"name": "s", "mode": "one_step"}],
             [{"system": "s", "accelerators": 2, "train": 1, "rollout": 1}],
             **{"data.buffer_when_full": "drop_oldest"})
    with pytest.raises(ValueError, match="buffer_groups"):
        tiny(LAMINAR, ONE, **{"data.buffer_groups": 1})   # a global batch is 2 groups


def test_caps_are_errors_naming_the_cap_and_the_cell():
    cfg = slow_learner(LAMINAR, **{"run.max_trajectories": 40})
    with pytest.raises(CapReached, match=r"cell lam@3 .*run\.max_trajectories"):
        Sim(cfg, cfg.cells[0]).run()
    cfg = slow_learner(LAMINAR, **{"run.max_time_s": 30.0})
    with pytest.raises(CapReached, match=r"run\.max_time_s"):
        Sim(cfg, cfg.cells[0]).run()


def test_a_rollout_waits_for_a_version_still_in_the_chain():
    """Chain transit of 2 s per hop (t_start), pull 2 s: a rollout asking right after a publish
    waits for its relay to hold the version, so some waits exceed the pull alone."""
    over = {"model.weights.t_start_s": 2.0, "model.weights.t_byte_s": 0.0,
            "run.warmup_steps": 2, "run.measure_steps": 4, "cluster.accelerators_per_machine": 1}
    cfg = tiny(LAMINAR, ONE, **over)
    sim = Sim(cfg, cfg.cells[0]).run()
    waits = np.array(sim.weight_waits)
    pull = sim.pull_time
    assert waits.size and waits.min() >= pull - 1e-9
    assert waits.max() > pull + 1.0           # the second relay is 2 s down the chain
    assert sim.summary()["weight_wait_s"] == pytest.approx(waits.mean())
