"""PartialPool: latest snapshot wins, take_for re-issue, reassign, stats, resume."""
from __future__ import annotations

import json

import numpy as np
import pytest

from laminar_jax.data import PartialPool, PartialTrajectory, parse_request_id, request_id


def _p(gid, i, rollout, n, repack=0, versions=None, finish=None):
    versions = versions if versions is not None else [0] * n
    return PartialTrajectory(gid, i, rollout, [1, 2], list(range(10, 10 + n)), [-0.1] * n, [-0.2] * n, versions,
                             prompt_id=f"p-{gid}", repack_count=repack, finish_reason=finish)


def test_latest_snapshot_wins_and_older_ones_are_ignored():
    pool = PartialPool()
    assert pool.update([_p("g", 0, "r0", 2), _p("g", 1, "r0", 1)]) == 2
    assert pool.update([_p("g", 0, "r0", 5)]) == 1
    assert pool.update([_p("g", 0, "r0", 3)]) == 0  # reordered late message
    assert pool.update([_p("g", 0, "r1", 1, repack=1)]) == 1  # moved: a new holder restarts its count
    assert pool.update([_p("g", 0, "r0", 9)]) == 0  # the old holder's late snapshot
    (entry,) = pool.get(group_id="g", rollout_id="r1")
    assert (entry.rollout_id, entry.num_tokens, entry.repack_count) == ("r1", 1, 1)
    assert pool.stats()["stale_updates"] == 2


def test_take_for_removes_or_reassigns_a_rollouts_trajectories():
    pool = PartialPool()
    pool.update([_p("a", 1, "dead", 3), _p("a", 0, "dead", 2), _p("b", 0, "alive", 4)])
    moved = pool.take_for("dead", reassign_to="new")
    assert [(p.key, p.rollout_id, p.repack_count) for p in moved] == [(("a", 0), "new", 1), (("a", 1), "new", 1)]
    assert len(pool) == 3 and pool.get(rollout_id="dead") == []
    taken = pool.take_for("new")
    assert [p.key for p in taken] == [("a", 0), ("a", 1)] and len(pool) == 1
    np.testing.assert_array_equal(taken[1].response_tokens, [10, 11, 12])
    assert pool.take_for("nobody") == []


def test_drop_groups_and_stats():
    pool = PartialPool()
    pool.update([_p("a", 0, "r0", 3, versions=[1, 1, 2]), _p("a", 1, "r0", 2, finish="stop"),
                 _p("b", 0, "r1", 1, versions=[2])])
    s = pool.stats()
    assert (s["trajectories"], s["tokens"], s["finished"], s["mixed_version"]) == (3, 6, 1, 1)
    assert s["by_rollout"] == {"r0": 2, "r1": 1} and s["tokens_by_version"] == {0: 2, 1: 2, 2: 2}
    assert pool.drop_groups("a") == 2 and [p.key for p in pool.get()] == [("b", 0)]


def test_state_dict_round_trip():
    pool = PartialPool()
    pool.update([_p("a", 0, "r0", 3, repack=2, versions=[4, 5, 5]), _p("b", 1, "r1", 0)])
    restored = PartialPool()
    restored.load_state_dict(json.loads(json.dumps(pool.state_dict())))
    assert restored.state_dict() == pool.state_dict()
    (a,) = restored.get(group_id="a")
    assert a.token_versions.dtype == np.int64 and a.behaviour_logp.dtype == np.float32
    np.testing.assert_array_equal(a.token_versions, [4, 5, 5])


def test_record_validation_and_request_ids():
    with pytest.raises(ValueError, match="token_versions has 1 values for 2 tokens"):
        PartialTrajectory("g", 0, "r", [1], [2, 3], [0, 0], [0, 0], [0])
    with pytest.raises(ValueError, match="expected a 1-D sequence of ints"):
        PartialTrajectory("g", 0, "r", [1.5], [], [], [], [])
    assert parse_request_id(request_id("e1-7", 3)) == ("e1-7", 3)
    with pytest.raises(ValueError, match="group_id>/<sample_index"):
        parse_request_id("nope")
