"""ExperienceBuffer: whole groups, samplers, staleness filter, back-pressure, eviction, resume."""
from __future__ import annotations

import json

import numpy as np
import pytest

from laminar_jax.data import ExperienceBuffer, Trajectory
from laminar_jax.data.samplers import UniformSampler


def _group(gid: str, version: int = 0, size: int = 2, versions=None) -> list[Trajectory]:
    versions = versions or [version] * 3
    return [Trajectory(gid, f"p-{gid}", i, "r0", [1, 2], [3, 4, 5], [-0.5, -0.2, -0.1], [-0.4, -0.2, -0.1],
                       versions, max(versions), float(i), "stop", timings={"finished": 1.0}) for i in range(size)]


def _fill(buf, n, version=0):
    for i in range(n):
        assert buf.put(_group(f"g{i}", version))


def _sampled_ids(groups):
    return [g[0].group_id for g in groups]


def test_fifo_newest_and_whole_groups():
    fifo, newest = ExperienceBuffer(10), ExperienceBuffer(10, sampler="newest")
    for buf in (fifo, newest):
        _fill(buf, 5)
    got = fifo.sample(2, 0)
    assert _sampled_ids(got) == ["g0", "g1"]
    assert all([t.sample_index for t in g] == [0, 1] for g in got)
    assert _sampled_ids(newest.sample(2, 0)) == ["g4", "g3"]
    assert fifo.group_ids() == ["g2", "g3", "g4"] and fifo.accounting()["consumed_trajectories"] == 4


def test_sample_is_all_or_nothing_unless_allow_fewer():
    buf = ExperienceBuffer(10)
    _fill(buf, 2)
    assert buf.sample(3, 0) == [] and len(buf) == 2
    assert _sampled_ids(buf.sample(3, 0, allow_fewer=True)) == ["g0", "g1"]


def test_uniform_sampler_is_deterministic_by_seed_and_survives_resume():
    def draws(seed, resume_after=None):
        buf = ExperienceBuffer(100, sampler="uniform", seed=seed)
        _fill(buf, 40)
        out = []
        for step in range(6):
            if step == resume_after:
                state = json.loads(json.dumps(buf.state_dict()))
                buf = ExperienceBuffer(100, sampler="uniform", seed=seed)
                buf.load_state_dict(state)
            out.append(_sampled_ids(buf.sample(3, 0)))
        return out

    a = draws(7)
    assert a == draws(7) == draws(7, resume_after=3)
    assert a != draws(8)
    flat = [g for batch in a for g in batch]
    assert len(flat) == len(set(flat)) == 18


def test_uniform_sampler_is_uniform():
    # Every one of 5 groups is picked with probability 2/5 per draw of 2.
    sampler = UniformSampler(seed=0)
    counts = np.zeros(5)
    for _ in range(4000):
        picked = sampler.select(list(range(5)), 2)
        assert len(set(picked)) == 2
        counts[picked] += 1
    np.testing.assert_allclose(counts / 4000, 0.4, atol=0.03)


def test_staleness_filter_drops_counts_and_reports():
    buf = ExperienceBuffer(10, max_staleness=1)
    for gid, v in [("a", 0), ("b", 1), ("c", 2), ("d", 3)]:
        buf.put(_group(gid, v))
    # mixed-version group: staleness counts from its oldest token
    buf.put(_group("e", versions=[0, 3, 3]))
    assert buf.staleness(3) == [3, 2, 1, 0, 3]
    got = buf.sample(2, learner_version=3)
    assert _sampled_ids(got) == ["c", "d"]
    acct = buf.accounting()
    assert (acct["dropped_stale"], acct["consumed"], acct["buffered"]) == (3, 2, 0)
    dropped = buf.pop_dropped()
    assert [(d.group_id, d.reason, d.staleness) for d in dropped] == [("a", "stale", 3), ("b", "stale", 2),
                                                                        ("e", "stale", 3)]
    assert buf.pop_dropped() == []
    assert ExperienceBuffer(10).sample(1, 100) == []  # no filter by default: nothing to sample, nothing dropped


def test_no_filter_keeps_old_groups():
    buf = ExperienceBuffer(10)
    buf.put(_group("old", 0))
    assert _sampled_ids(buf.sample(1, learner_version=50)) == ["old"]


def test_back_pressure_put_returns_false_until_there_is_room():
    buf = ExperienceBuffer(2)
    _fill(buf, 2)
    assert buf.put(_group("g2")) is False and buf.put(_group("g2")) is False
    assert buf.accounting()["rejected_full"] == 2 and len(buf) == 2
    buf.sample(1, 0)
    assert buf.put(_group("g2")) is True
    assert buf.group_ids() == ["g1", "g2"]


def test_full_buffer_drops_stale_groups_before_refusing():
    buf = ExperienceBuffer(2, max_staleness=0)
    assert buf.sample(1, learner_version=1) == []  # the buffer learns the learner's version
    buf.put(_group("a", 0))  # already stale on arrival, kept until room is needed
    buf.put(_group("b", 1))
    assert buf.put(_group("c", 1)) is True
    acct = buf.accounting()
    assert (acct["dropped_stale"], acct["rejected_full"], acct["evicted"]) == (1, 0, 0)
    assert buf.group_ids() == ["b", "c"]
    assert buf.put(_group("d", 1)) is False  # nothing stale left: back-pressure


def test_eviction_policies():
    oldest = ExperienceBuffer(2, eviction="drop_oldest")
    stalest = ExperienceBuffer(2, eviction="drop_stalest")
    for buf in (oldest, stalest):
        buf.put(_group("x", 5))
        buf.put(_group("y", 1))
        assert buf.put(_group("z", 6))
        assert buf.accounting()["evicted"] == 1
    assert oldest.group_ids() == ["y", "z"] and stalest.group_ids() == ["x", "z"]
    assert [d.group_id for d in oldest.pop_dropped()] == ["x"]
    assert [(d.group_id, d.reason) for d in stalest.pop_dropped()] == [("y", "evicted")]


def test_duplicates_are_counted_and_not_stored():
    buf = ExperienceBuffer(1)
    assert buf.put(_group("g"))
    assert buf.put(_group("g")) is True  # even when full: no retry for a duplicate
    buf.sample(1, 0)
    assert buf.put(_group("g")) is True and len(buf) == 0  # consumed groups stay seen
    acct = buf.accounting()
    assert (acct["received"], acct["duplicates"]) == (1, 2)
    assert buf.seen_among(["g", "h"]) == ["g"]


def test_put_rejects_partial_or_mixed_groups():
    buf = ExperienceBuffer(4)
    with pytest.raises(ValueError, match="sample indices"):
        buf.put(_group("g", size=3)[1:])
    with pytest.raises(ValueError, match="share group_id"):
        buf.put(_group("a", size=1) + [_group("b", size=2)[1]])
    with pytest.raises(ValueError, match="empty group"):
        buf.put([])


def test_state_dict_round_trip_keeps_groups_order_and_counts():
    buf = ExperienceBuffer(5, max_staleness=3)
    _fill(buf, 4, version=2)
    buf.sample(1, 2)
    state = json.loads(json.dumps(buf.state_dict()))
    restored = ExperienceBuffer(5, max_staleness=3)
    restored.load_state_dict(state)
    assert restored.accounting() == buf.accounting()
    assert _sampled_ids(restored.sample(3, 2)) == _sampled_ids(buf.sample(3, 2)) == ["g1", "g2", "g3"]
    a, b = restored.state_dict(), buf.state_dict()
    assert a == b
    assert restored.put(_group("g0")) and restored.accounting()["duplicates"] == 1


def test_trajectory_record_validation_and_log_row():
    t = _group("g", versions=[3, 4, 4])[0]
    assert (t.oldest_version, t.mixed_versions, t.staleness(6)) == (3, True, 3)
    row = t.log_row(learner_version=6)
    assert (row["response_len"], row["staleness"], row["gen_version"], row["t_finished"]) == (3, 3, 4, 1.0)
    with pytest.raises(ValueError, match="reward must be a finite float"):
        Trajectory("g", "p", 0, "r", [1], [2], [0.0], [0.0], [0], 0, float("nan"), "stop")
    with pytest.raises(ValueError, match="behaviour_logp: expected 2 values"):
        Trajectory("g", "p", 0, "r", [1], [2, 3], [0.0], [0.0, 0.0], [0, 0], 0, 1.0, "stop")
    with pytest.raises(ValueError, match="finish_reason"):
        Trajectory("g", "p", 0, "r", [1], [2], [0.0], [0.0], [0], 0, 1.0, "eos")
