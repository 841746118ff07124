"""PromptPool: seeded cursor, re-queue at the front, idempotent completion, exact resume."""
from __future__ import annotations

import json

import numpy as np
import pytest

from laminar_jax.data import CharTokenizer, PromptEncoder, PromptPool, PromptRow


def _rows(n: int) -> list[PromptRow]:
    return [PromptRow(f"p{i}", f"prompt {i}", str(i), {"i": i}) for i in range(n)]


def _pool(n=10, **kw) -> PromptPool:
    kw.setdefault("group_size", 4)
    return PromptPool(_rows(n), **kw)


def _ids(groups):
    return [g.prompt_id for g in groups]


def test_each_epoch_is_a_seeded_permutation_of_all_prompts():
    pool = _pool(10, seed=3)
    first, second = _ids(pool.issue(10, "r")), _ids(pool.issue(10, "r"))
    assert sorted(first) == sorted(second) == sorted(f"p{i}" for i in range(10))
    assert first != second  # a new permutation per epoch
    again = _pool(10, seed=3)
    assert _ids(again.issue(20, "r")) == first + second  # same seed, same order
    assert _ids(_pool(10, seed=4).issue(10, "r")) != first
    assert _ids(_pool(10, shuffle=False).issue(10, "r")) == [f"p{i}" for i in range(10)]


def test_group_records_carry_ids_tokens_and_size():
    tok = CharTokenizer()
    pool = _pool(3, shuffle=False, encode=PromptEncoder(tok))
    g = pool.issue(1, "r0")[0]
    assert (g.group_id, g.prompt_id, g.epoch, g.index, g.group_size, g.attempt) == ("e0-0", "p0", 0, 0, 4, 0)
    assert tok.decode(g.prompt_tokens) == "prompt 0" and g.answer == "0" and g.row == {"i": 0}
    assert g.request_ids() == ["e0-0/0", "e0-0/1", "e0-0/2", "e0-0/3"]


def test_requeued_groups_go_to_the_front_in_order_and_are_issued_once():
    pool = _pool(10, shuffle=False)
    a = pool.issue(3, "dead")
    pool.issue(2, "alive")
    assert pool.requeue_rollout("dead") == [g.group_id for g in a]
    acct = pool.accounting()
    assert (acct["issued"], acct["in_flight"], acct["requeued"], acct["completed"]) == (5, 2, 3, 0)
    again = pool.issue(4, "new")
    assert [g.group_id for g in again[:3]] == [g.group_id for g in a]
    assert [g.attempt for g in again] == [1, 1, 1, 0]
    assert again[3].group_id == "e0-5"  # then the cursor goes on
    assert pool.accounting()["issued"] == 6  # a re-issue is not a new issue


def test_complete_is_idempotent_and_accepts_a_requeued_group():
    pool = _pool(5, shuffle=False)
    g0, g1 = pool.issue(2, "r0")
    assert pool.complete(g0.group_id) == 1
    assert pool.complete(g0.group_id) == 0  # a duplicate delivery
    pool.requeue([g1.group_id])
    assert pool.status(g1.group_id) == "requeued"
    assert pool.complete([g1.group_id]) == 1  # the "dead" rollout delivered after all
    assert pool.status(g1.group_id) == "completed"
    assert pool.issue(1, "r1")[0].group_id == "e0-2"  # g1 is not issued again
    assert pool.requeue(g0.group_id) == []  # a completed group cannot be re-queued
    acct = pool.accounting()
    assert acct["duplicate_completions"] == 1 and acct["ignored_requeues"] == 1
    assert acct["issued"] == acct["in_flight"] + acct["requeued"] + acct["completed"] == 3
    with pytest.raises(ValueError, match="never issued"):
        pool.complete("e0-4")
    assert pool.status("e0-4") == "pending"


def test_reassign_moves_a_group_to_another_rollout():
    pool = _pool(5)
    g = pool.issue(1, "r0")[0]
    pool.reassign([g.group_id], "r1")
    assert pool.holders() == {g.group_id: "r1"} and pool.requeue_rollout("r0") == []
    with pytest.raises(ValueError, match="not in flight"):
        pool.reassign(["e0-3"], "r1")


def test_max_epochs_stops_fresh_groups_but_not_requeued_ones():
    pool = _pool(3, max_epochs=1)
    groups = pool.issue(5, "r")
    assert len(groups) == 3
    pool.requeue(groups[0].group_id)
    assert not pool.exhausted()
    assert [g.group_id for g in pool.issue(5, "r")] == [groups[0].group_id]
    assert pool.exhausted()


def test_state_dict_round_trip_resumes_without_loss_or_repeat():
    """Run A straight through; run B saves mid-way (with groups in flight and re-queued),
    restores into a fresh pool, and goes on. Every group is completed exactly once in both, and
    B's fresh groups come in A's order."""
    ref = _pool(7, seed=11)
    ref_order = [g.group_id for g in ref.issue(20, "r")]

    pool = _pool(7, seed=11)
    issued = pool.issue(6, "r0")
    pool.complete([g.group_id for g in issued[:2]])
    pool.requeue([issued[2].group_id])
    state = json.loads(json.dumps(pool.state_dict()))  # JSON-safe

    restored = _pool(7, seed=11)
    restored.load_state_dict(state)
    acct = restored.accounting()
    assert (acct["issued"], acct["in_flight"], acct["requeued"], acct["completed"]) == (6, 0, 4, 2)
    rest = restored.issue(18, "r1")
    # re-queued first (the one re-queued before the save, then those in flight at save time)
    assert [g.group_id for g in rest[:4]] == [issued[i].group_id for i in (2, 3, 4, 5)]
    assert [g.prompt_id for g in rest[:4]] == [issued[i].prompt_id for i in (2, 3, 4, 5)]
    done = [g.group_id for g in issued[:2]] + [g.group_id for g in rest]
    assert sorted(done) == sorted(ref_order[:20])
    assert len(set(done)) == len(done)
    assert [g.group_id for g in rest[4:]] == ref_order[6:20]


def test_load_state_dict_refuses_other_prompts_or_settings():
    state = _pool(5, seed=1).state_dict()
    with pytest.raises(ValueError, match="fingerprint"):
        PromptPool([PromptRow(f"q{i}", "x", None) for i in range(5)], group_size=4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="group_size"):
        _pool(5, seed=1, group_size=8).load_state_dict(state)


def test_requeue_in_flight_false_keeps_holders():
    pool = _pool(5)
    g = pool.issue(2, "r0")
    restored = _pool(5)
    restored.load_state_dict(pool.state_dict(), requeue_in_flight=False)
    assert restored.holders() == {x.group_id: "r0" for x in g}
    assert np.array_equal(restored.in_flight()[0].prompt_tokens, g[0].prompt_tokens)


def test_bad_construction_is_reported():
    with pytest.raises(ValueError, match="no prompts"):
        PromptPool([], group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        _pool(3, group_size=0)
