"""The mode table (`modes.MODE_RULES`): one row per mode, read by every predicate, the config
schemas and the simulator's policies; a new mode is one row (shown with a k-stale global-batch
mode added here only)."""
import dataclasses
import typing

import pytest

from laminar_jax.config import ManagerConfig
from laminar_jax.manager import modes
from laminar_jax.sim.config import SystemSpec


def test_the_literals_derive_from_the_table():
    names = tuple(modes.MODE_RULES)
    assert modes.MODES == names
    assert typing.get_args(modes.Mode) == names
    for schema in (ManagerConfig, SystemSpec):
        assert typing.get_args(typing.get_type_hints(schema)["mode"]) == names


def test_predicates_read_the_rows():
    for name, r in modes.MODE_RULES.items():
        assert modes.uses_global_batches(name) is r.global_batches
        assert modes.interrupts_on_publish(name) is r.interrupts_on_publish
        assert modes.streams_minibatches(name) is r.streams_minibatches
        assert modes.refills_continuously(name) is r.refills_continuously
        assert modes.repacks(name, enabled=True) is r.may_repack
        assert modes.repacks(name, enabled=False) is False
        assert modes.staleness_bound(name) == r.staleness_bound
        assert modes.staleness_bound(name, max_staleness=3) == (3 if r.bound_from_setting
                                                                else r.staleness_bound)


def test_rows_are_frozen_and_checked():
    with pytest.raises(dataclasses.FrozenInstanceError):
        modes.MODE_RULES["sync"].staleness_bound = 3
    with pytest.raises(ValueError, match="global_batches needs a staleness_bound"):
        modes.ModeRules("bad", global_batches=True)
    with pytest.raises(ValueError, match="interrupts_on_publish needs refills_continuously"):
        modes.ModeRules("bad", interrupts_on_publish=True)


K = 2


@pytest.fixture
def k_stale(monkeypatch):
    """An example mode, added in this test only: global batches generated up to K versions
    behind the learner (no streaming, no interrupts)."""
    row = modes.ModeRules("k_stale", global_batches=True, staleness_bound=K)
    monkeypatch.setitem(modes.MODE_RULES, row.name, row)
    return row


def test_an_added_mode_reaches_the_runtime_rules(k_stale):
    assert modes.check_mode("k_stale") == "k_stale"
    assert modes.staleness_bound("k_stale") == K
    # the data actor's issue limit: batches up to weight_version + K may go out
    assert modes.fresh_issue_limit("k_stale", next_position=0, weight_version=0,
                                   learner_version=0, global_batch=4,
                                   max_staleness=None) == (K + 1) * 4
    assert not modes.may_pull_weights("k_stale", in_flight=3)


def test_an_added_mode_runs_in_the_simulator(k_stale):
    from laminar_jax.sim.engine import Sim
    from laminar_jax.sim.global_batch import GlobalBatch
    from tests.laminar_jax.sim.test_sim_engine import tiny

    base = tiny([{"name": "s", "mode": "one_step"}],
                [{"system": "s", "accelerators": 2, "train": 1, "rollout": 1}],
                **{"run.warmup_steps": 1, "run.measure_steps": 6,
                   "model.trainer.seconds_per_token": 4e-3})
    cfg = dataclasses.replace(base, systems=(SystemSpec(name="s", mode="k_stale"),))
    sim = Sim(cfg, cfg.cells[0]).run()
    assert isinstance(sim.policy, GlobalBatch) and sim.policy.bound == K
    one = Sim(base, base.cells[0]).run()
    # learner-bound (training takes ~3x a batch's generation): the fleet runs ahead until
    # batch k starts on version k - K, so the staleness reaches K, above one_step's 1, and
    # never exceeds it
    assert max(s["staleness_max"] for s in sim.steps) == K
    assert max(s["staleness_max"] for s in one.steps) == 1
