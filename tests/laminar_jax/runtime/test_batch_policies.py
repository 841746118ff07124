"""Pure parts of the runtime: batch assembly, the modes' issue rules, and the data actor's gating
and ledger (in-process, no Ray)."""
import numpy as np
import pytest

from laminar_jax.data.records import PromptRow, Trajectory
from laminar_jax.manager import modes
from laminar_jax.runtime import batch as B
from laminar_jax.runtime.data_actor import DataActor


def traj(gid, i, prompt, resp, versions, reward=1.0):
    n = len(resp)
    return Trajectory(gid, "p", i, "r0", np.asarray(prompt), np.asarray(resp), -np.arange(1, n + 1) / 10,
                      -np.arange(1, n + 1) / 10, np.asarray(versions), int(versions[-1]), reward, "stop")


def test_assemble_aligns_tokens_logp_and_staleness():
    g0 = [traj("e0-0", 0, [5, 6], [7, 8, 9], [2, 2, 3]), traj("e0-0", 1, [5, 6], [7], [3], 0.0)]
    out = B.assemble([g0], learner_version=4, max_seq_len=64, min_len=8)
    assert out["tokens"].shape == (2, 8)
    np.testing.assert_array_equal(out["tokens"][0, :5], [5, 6, 7, 8, 9])
    np.testing.assert_array_equal(out["response_mask"][0], [0, 0, 1, 1, 1, 0, 0, 0])
    np.testing.assert_allclose(out["behaviour_logp"][0, 2:5], [-0.1, -0.2, -0.3], rtol=1e-6)
    np.testing.assert_array_equal(out["staleness"][0, 2:5], [2, 2, 1])
    np.testing.assert_array_equal(out["segment_ids"][1], [1, 1, 1, 0, 0, 0, 0, 0])
    assert out["rewards"].tolist() == [1.0, 0.0] and out["group_ids"].tolist() == [0, 0]
    stats = B.staleness_stats([g0], 4)
    assert stats["staleness_max"] == 2 and stats["mixed_version_frac"] == 0.5


def test_bucket_len_and_errors():
    assert B.bucket_len(17, max_len=256, min_len=16) == 32
    assert B.bucket_len(3, max_len=256, min_len=64) == 64
    assert B.bucket_len(200, max_len=200) == 200
    with pytest.raises(ValueError, match="max_seq_len=8"):
        B.bucket_len(9, max_len=8)


def test_row_reach_is_the_longest_prompt_that_fits_plus_max_new_tokens():
    from laminar_jax.config import Config, EnvConfig, LearnerConfig, RolloutConfig
    cfg = Config(learner=LearnerConfig(max_seq_len=256), rollout=RolloutConfig(max_new_tokens=64))
    assert B.row_reach(cfg, [12, 20, 17]) == 84
    assert B.row_reach(cfg, [20, 192, 300]) == 256   # 300 has no room: rejected by the rollouts
    assert B.row_reach(cfg, [20, 193]) == 84
    assert B.row_reach(cfg, [300]) is None
    multi_turn = Config(learner=cfg.learner, rollout=cfg.rollout, env=EnvConfig(name="lookup"))
    assert B.row_reach(multi_turn, [20]) is None   # turns and tool output add tokens


def test_issue_limit_matches_may_start_batch():
    for mode in ("sync", "one_step", "stream"):
        for v in range(4):
            for pos in range(v * 4, v * 4 + 12):
                limit = modes.fresh_issue_limit(mode, next_position=pos, weight_version=v, learner_version=v,
                                                global_batch=4, max_staleness=1)
                allowed = [p for p in range(pos, pos + 40)
                           if modes.may_start_batch(p // 4, v, bound=modes.staleness_bound(mode, max_staleness=1))]
                # the limit counts exactly the consecutive allowed positions from the cursor on
                run = 0
                while pos + run in allowed:
                    run += 1
                assert limit == run, (mode, v, pos)
    assert modes.fresh_issue_limit("laminar", next_position=99, weight_version=0, learner_version=0,
                                   global_batch=4, max_staleness=None) is None
    # partial: AReaL's may_submit, group by group
    for lv in range(3):
        limit = modes.fresh_issue_limit("partial", next_position=5, weight_version=0, learner_version=lv,
                                        global_batch=4, max_staleness=1)
        run = 0
        while modes.may_submit(5 + run, lv, batch_size=4, eta=1):
            run += 1
        assert limit == run


def make_actor(mode):
    rows = [PromptRow(f"q{i}", f"{i}+1=", str(i + 1), {"task": "arithmetic", "answer": str(i + 1)}) for i in range(10)]
    return DataActor(dict(rows=rows, group_size=2, shuffle=False, encode=lambda s: [3, 4]),
                     dict(capacity_groups=16), mode=mode, global_batch=2, max_staleness=1)


def deliver(actor, group, version):
    ts = [traj(group.group_id, i, [3, 4], [5], [version]) for i in range(2)]
    assert actor.deliver(ts)


def test_sync_gating_and_batch_sampling():
    a = make_actor("sync")
    got = a.issue(5, "r0", weight_version=0)
    assert [g.group_id for g in got] == ["e0-0", "e0-1"], "sync: batch 0 only, on version 0"
    assert a.issue(5, "r1", weight_version=0) == []
    deliver(a, got[1], 0)
    assert a.sample(2, 0, batch_index=0) == [], "batch 0 is not complete yet"
    deliver(a, got[0], 0)
    batch = a.sample(2, 0, batch_index=0)
    assert sorted(t[0].group_id for t in batch) == ["e0-0", "e0-1"]
    assert [g.group_id for g in a.issue(5, "r0", weight_version=1)] == ["e0-2", "e0-3"]
    acc = a.accounting()
    assert acc["issued"] == 4 and acc["consumed"] == 2 and acc["in_flight"] == 2 and acc["unaccounted"] == 0


def test_requeue_and_orphans_keep_the_ledger():
    a = make_actor("laminar")
    got = a.issue(3, "r0", weight_version=0)
    deliver(a, got[0], 0)
    groups, partials = a.orphans("r0")
    assert [g.group_id for g in groups] == ["e0-1", "e0-2"]
    a.requeue([g.group_id for g in groups] + ["e0-0"])
    acc = a.accounting()
    assert acc["requeued"] == 2 and acc["buffered"] == 1 and acc["unaccounted"] == 0
    again = a.issue(1, "r1", weight_version=0)
    assert again[0].group_id == "e0-1" and again[0].attempt == 1
    a.reject("e0-2", "prompt too long")
    acc = a.accounting()
    assert acc["rejected"] == 1 and acc["unaccounted"] == 0


def test_partial_mode_drops_groups_past_its_bound_and_issues_from_the_older_version():
    a = make_actor("partial")  # eta = max_staleness = 1, global batch 2
    # learner at 3, rollout still on 0: positions below (0 + 1 + 1) * 2 only
    a.set_learner_version(3)
    assert [g.group_id for g in a.issue(5, "r0", weight_version=0)] == ["e0-0", "e0-1", "e0-2", "e0-3"]
    a2 = make_actor("partial")
    got = a2.issue(2, "r0", weight_version=0)
    deliver(a2, got[0], 0)
    deliver(a2, got[1], 1)
    batch = a2.sample(1, 2)  # got[0] is 2 versions old at learner version 2 > eta: dropped
    assert [t[0].group_id for t in batch] == [got[1].group_id]
    acc = a2.accounting()
    assert acc["dropped"] == 1 and acc["consumed"] == 1 and acc["unaccounted"] == 0


def test_partial_mode_gives_a_dropped_groups_slot_back():
    a = make_actor("partial")  # eta 1, global batch 2: (v + 2) * 2 accepted submissions
    got = a.issue(4, "r0", weight_version=0)
    deliver(a, got[0], 0)
    deliver(a, got[1], 1)
    assert [t[0].group_id for t in a.sample(1, 2)] == [got[1].group_id]  # got[0] dropped as stale
    # 4 issued, 1 of them dropped: 3 accepted, so (2 + 2) * 2 - 3 = 5 more may go out on version 2
    assert len(a.issue(10, "r0", weight_version=2)) == 5


def test_the_data_actor_hands_each_learner_host_a_disjoint_part_of_the_batch():
    """learner.hosts = 2: the leader's call samples the global batch and gets its part; the other
    host takes its own with the ticket, once; the parts are disjoint whole groups whose union is
    the batch."""
    a = make_actor("laminar")
    issued = a.issue(4, "r0", weight_version=0)
    for g in issued:
        deliver(a, g, 0)
    ticket, mine = a.wait_sample_hosts(4, 0, None, 1.0, hosts=2)
    theirs = a.host_part(ticket, 1)
    ids = [[t[0].group_id for t in part] for part in (mine, theirs)]
    assert len(ids[0]) == len(ids[1]) == 2 and not set(ids[0]) & set(ids[1])
    assert sorted(ids[0] + ids[1]) == sorted(g.group_id for g in issued)
    assert all(len({t.group_id for t in g}) == 1 and len(g) == 2 for part in (mine, theirs) for g in part)
    with pytest.raises(KeyError, match="no part of batch .* for learner host 1"):
        a.host_part(ticket, 1)
    assert a.wait_sample_hosts(4, 0, None, 0.01, hosts=2) is None   # nothing buffered: None, not an error
    from laminar_jax.runtime.data_actor import host_parts
    with pytest.raises(ValueError, match="do not split over learner.hosts=3"):
        host_parts(list(range(4)), 3)


def test_a_host_part_assembles_at_the_agreed_length_and_packs_to_the_agreed_rows():
    g0 = [traj("e0-0", 0, [5, 6], [7, 8, 9], [2, 2, 3]), traj("e0-0", 1, [5, 6], [7], [3], 0.0)]
    out = B.assemble([g0], learner_version=4, max_seq_len=64, min_len=8, rows=4, length=32)
    assert out["tokens"].shape == (4, 32) and out["valid"].tolist() == [1, 1, 0, 0]
    pad = B.assemble([], learner_version=4, max_seq_len=64, rows=2, length=32)   # a host left with no group
    assert pad["tokens"].shape == (2, 32) and not pad["valid"].any() and not pad["response_mask"].any()
    with pytest.raises(ValueError, match="length=4 is shorter"):
        B.assemble([g0], learner_version=4, max_seq_len=64, length=4)
    packed = B.pack(out, max_seq_len=8, row_multiple=1)
    assert packed["tokens"].shape == (1, 8)   # 5 + 3 tokens share a row
    wide = B.pack(out, max_seq_len=8, row_multiple=1, min_rows=3)
    assert wide["tokens"].shape == (4, 8) and np.array_equal(wide["tokens"][:1], packed["tokens"]) and not wide["segment_ids"][1:].any()
