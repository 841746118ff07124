"""Tests for the repack plan (Algorithm 1 of Laminar §5) in laminar_jax/manager/repack.py."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_jax.manager.repack import Move, RolloutLoad, is_candidate, plan

# KV values are multiples of 1/64, so every sum the plan and these checks form is exact in
# binary floating point and the capacity bounds can be asserted without a tolerance.
UNIT = 1 / 64


def _load(rid, version, kv_used, kv_prev, num_running):
    return RolloutLoad(
        id=rid, version=version, kv_used=kv_used, kv_prev=kv_prev, num_running=num_running
    )


@st.composite
def fleets(draw):
    n = draw(st.integers(0, 40))
    ids = draw(
        st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=n, max_size=n, unique=True)
    )
    loads = []
    for rid in ids:
        loads.append(
            _load(
                rid,
                draw(st.integers(0, 2)),
                draw(st.integers(0, 64)) * UNIT,
                draw(st.integers(0, 64)) * UNIT,
                draw(st.integers(0, 12) | st.integers(0, 60)),
            )
        )
    c_max = draw(st.integers(16, 64)) * UNIT
    batch = draw(st.integers(1, 64))
    return loads, c_max, batch


def _random_fleet(rng, n, versions=3):
    loads = []
    for i in range(n):
        loads.append(
            _load(
                f"r{rng.randrange(10**6):06d}-{i}",
                rng.randrange(versions),
                rng.randrange(65) * UNIT,
                rng.randrange(65) * UNIT,
                rng.randrange(0, 300),
            )
        )
    return loads


def _check_invariants(loads, moves, c_max, batch):
    by_id = {r.id: r for r in loads}
    sources = [m.source for m in moves]
    destinations = {m.destination for m in moves}
    assert len(sources) == len(set(sources)), "a rollout released twice"
    assert not destinations & set(sources), "a rollout is both source and destination"
    for m in moves:
        src, dst = by_id[m.source], by_id[m.destination]
        assert src.version == dst.version == m.version, f"move {m} crosses versions"
        for r in (src, dst):
            assert is_candidate(r, c_max=c_max, roofline_batch=batch), f"{r} is not in ramp-down"
    for d in destinations:
        incoming = [by_id[m.source] for m in moves if m.destination == d]
        kv = by_id[d].kv_used + sum(r.kv_used for r in incoming)
        running = by_id[d].num_running + sum(r.num_running for r in incoming)
        assert kv <= c_max, f"destination {d} ends at KV {kv} > c_max {c_max}"
        assert running <= batch, f"destination {d} ends with {running} > roofline batch {batch}"


def _reference_plan(loads, c_max, batch):
    """Line-by-line transcription of the paper's pseudocode, plus the destination guard."""
    moves = []
    for version in sorted({r.version for r in loads}):
        group = [r for r in loads if r.version == version]
        S = [r for r in group if r.kv_used < min(c_max, r.kv_prev) and 0 < r.num_running < batch]
        S.sort(key=lambda r: (r.kv_used, r.id))
        P, E = [], set()

        def c_load(d):
            return d.kv_used + sum(x.kv_used for (x, y) in P if y is d)

        def can_fit(d, s):
            n_load = d.num_running + sum(x.num_running for (x, y) in P if y is d)
            return c_load(d) + s.kv_used <= c_max and n_load + s.num_running <= batch

        for s in S:
            if s in E or any(y is s for (_, y) in P):
                continue
            D = [d for d in S if d not in E and d is not s and can_fit(d, s)]
            if D:
                d_star = min(D, key=lambda d: (-c_load(d), d.id))
                P.append((s, d_star))
                E.add(s)
        moves += [Move(s.id, d.id, version) for (s, d) in P]
    return moves


@settings(max_examples=300, deadline=None)
@given(fleets())
def test_plan_invariants_and_reference(fleet):
    loads, c_max, batch = fleet
    moves = plan(loads, c_max=c_max, roofline_batch=batch)
    _check_invariants(loads, moves, c_max, batch)
    assert moves == _reference_plan(loads, c_max, batch)


@settings(max_examples=150, deadline=None)
@given(fleets(), st.randoms(use_true_random=False))
def test_plan_is_permutation_invariant(fleet, rnd):
    loads, c_max, batch = fleet
    shuffled = list(loads)
    rnd.shuffle(shuffled)
    expected = plan(loads, c_max=c_max, roofline_batch=batch)
    assert plan(shuffled, c_max=c_max, roofline_batch=batch) == expected


@pytest.mark.parametrize("seed", range(6))
def test_plan_seeded_large_fleets(seed):
    rng = random.Random(seed)
    loads = _random_fleet(rng, 300)
    c_max, batch = 63 * UNIT, 256
    moves = plan(loads, c_max=c_max, roofline_batch=batch)
    _check_invariants(loads, moves, c_max, batch)
    # About a third of a random fleet is in ramp-down; some of it must consolidate.
    assert moves
    rng.shuffle(loads)
    assert plan(loads, c_max=c_max, roofline_batch=batch) == moves
    assert plan(tuple(loads), c_max=c_max, roofline_batch=batch) == moves


@settings(max_examples=200, deadline=None)
@given(fleets())
def test_plan_empty_iff_fleet_packed(fleet):
    """No moves exactly when no two same-version candidates fit together.

    If some pair fits, take the first-visited candidate x of any such pair: before x, nothing
    moved (else the plan is non-empty already), so x is no destination and its partner is open,
    hence x moves.
    """
    loads, c_max, batch = fleet
    moves = plan(loads, c_max=c_max, roofline_batch=batch)
    assert (moves == []) == (not _has_unmerged_pair(loads, c_max, batch))


@settings(max_examples=200, deadline=None)
@given(fleets())
def test_plan_twice_moves_nothing(fleet):
    """Carrying out a plan leaves a packed fleet: re-planning on the resulting loads is empty."""
    loads, c_max, batch = fleet
    moves = plan(loads, c_max=c_max, roofline_batch=batch)
    by_id = {r.id: r for r in loads}
    released = {m.source for m in moves}
    after = []
    for r in loads:
        if r.id in released or not is_candidate(r, c_max=c_max, roofline_batch=batch):
            continue
        incoming = [by_id[m.source] for m in moves if m.destination == r.id]
        kv = r.kv_used + sum(x.kv_used for x in incoming)
        running = r.num_running + sum(x.num_running for x in incoming)
        # Next sample: still draining (prev above now), so every survivor stays a candidate
        # unless its load reached the bounds.
        after.append(_load(r.id, r.version, kv, kv + UNIT, running))
    assert plan(after, c_max=c_max, roofline_batch=batch) == []


def _has_unmerged_pair(loads, c_max, batch):
    cands = [r for r in loads if is_candidate(r, c_max=c_max, roofline_batch=batch)]
    return any(
        a.version == b.version
        and a.kv_used + b.kv_used <= c_max
        and a.num_running + b.num_running <= batch
        for a in cands
        for b in cands
        if a.id < b.id
    )


def test_packed_fleet_yields_no_moves():
    # C_max 0.98, B 64. Version-3 candidates pairwise overflow one bound:
    # a+b kv 1.03; a+c, b+c running 70; a+d, b+d running 65; c+d running 115.
    loads = [
        _load("a", 3, 0.50, 0.60, 10),
        _load("b", 3, 0.53, 0.70, 10),
        _load("c", 3, 0.20, 0.30, 60),
        _load("d", 3, 0.25, 0.40, 55),
        _load("e", 3, 0.99, 0.99, 200),  # saturated
        _load("f", 3, 0.10, 0.05, 2),  # ramping up: fits anywhere but is not in ramp-down
        _load("g", 4, 0.05, 0.10, 1),  # fits anywhere, but alone in its version group
    ]
    assert not _has_unmerged_pair(loads, 0.98, 64)
    assert plan(loads, c_max=0.98, roofline_batch=64) == []
    assert plan([], c_max=0.98, roofline_batch=64) == []


def test_hand_example_freed_count():
    """A 16-rollout fleet (the §8.4 setup has 16 rollouts), C_max = 0.99, B = 64, worked by hand.

    Candidates need kv_used < min(0.99, kv_prev) and 0 < num_running < 64:
      v7: r00 saturated (0.99), r01 ramping up, r03 steady (0.30 == prev: strict test fails),
          candidates r02 (0.20, 10), r04 (0.25, 20).
      v6: r05 saturated, r06 has 100 >= B running, r14 ramping up, r15 has nothing running,
          candidates by kv: r12 (.05, 2), r11 (.10, 4), r10 (.15, 6), r09 (.30, 20),
          r13 (.35, 50), r08 (.45, 30), r07 (.50, 40).
    v6, densest fitting destination each time (load shown as (kv, running) after the move):
      r12 -> r07 (.55, 42); r11 -> r07 (.65, 46); r10 -> r07 (.80, 52);
      r09: r13 would hold 70 > 64, r07 1.10 > .99, r08 fits -> r09 -> r08 (.75, 50);
      r13: r08 1.10, r07 1.15 -> stays; r08 and r07 are destinations -> never released.
    v7: r02 -> r04 (.45, 30); r04 is a destination. r02 never goes to r07 (other version).
    Freed: 4 + 1 = 5 rollouts.
    """
    v = [
        ("r00", 7, 0.99, 0.99, 200), ("r01", 7, 0.60, 0.40, 300), ("r02", 7, 0.20, 0.35, 10),
        ("r03", 7, 0.30, 0.30, 12), ("r04", 7, 0.25, 0.50, 20), ("r05", 6, 0.99, 0.99, 180),
        ("r06", 6, 0.90, 0.99, 100), ("r07", 6, 0.50, 0.55, 40), ("r08", 6, 0.45, 0.52, 30),
        ("r09", 6, 0.30, 0.40, 20), ("r10", 6, 0.15, 0.20, 6), ("r11", 6, 0.10, 0.12, 4),
        ("r12", 6, 0.05, 0.08, 2), ("r13", 6, 0.35, 0.45, 50), ("r14", 6, 0.70, 0.60, 150),
        ("r15", 6, 0.00, 0.02, 0),
    ]
    loads = [_load(*row) for row in v]
    moves = plan(loads, c_max=0.99, roofline_batch=64)
    assert len(moves) == 5
    assert moves == [
        Move("r12", "r07", 6), Move("r11", "r07", 6), Move("r10", "r07", 6),
        Move("r09", "r08", 6), Move("r02", "r04", 7),
    ]


def test_destination_guard():
    """Algorithm 1 as printed would release a rollout that has just received work.

    c_max 1, B 11. Visit order c (.1, 3), a (.3, 6), b (.3, 2) (a before b by id).
    c: a and b tie at .3, smallest id -> c -> a; a now holds (.4, 9).
    a: unguarded, it would move onto b (its own (.3, 6) as printed, or (.4, 9) with c's work
       counted: .7 and 11 <= 11 either way), a chain c -> a -> b. Guarded, a is a destination
       and stays.
    b: onto a (.4, 9): .7 and 11 fit -> b -> a. Two rollouts freed, a single hop each.
    """
    loads = [_load("a", 0, 0.3, 0.4, 6), _load("b", 0, 0.3, 0.4, 2), _load("c", 0, 0.1, 0.4, 3)]
    assert plan(loads, c_max=1.0, roofline_batch=11) == [Move("c", "a", 0), Move("b", "a", 0)]


def test_ties_broken_by_id():
    # Equal kv: visited by id, so "a" is the source; equal destination load: smallest id wins.
    loads = [_load("c", 1, 0.2, 0.3, 1), _load("b", 1, 0.2, 0.3, 1), _load("a", 1, 0.1, 0.3, 1)]
    assert plan(loads, c_max=1.0, roofline_batch=8) == [Move("a", "b", 1), Move("c", "b", 1)]


def test_destination_tie_broken_by_id_not_visit_order():
    # c_max 1, B 10, kv in units u = 1/64. Visit order a (2u, 5), s (3u, 1), x (4u, 1), b (6u, 6).
    # a: b would hold 11 > 10 running, so a -> x; x now (6u, 6). s: x (6u) and b (6u) tie,
    # smallest id wins -> s -> b, although x comes first in visit order.
    loads = [
        _load("a", 0, 2 * UNIT, 1.0, 5),
        _load("s", 0, 3 * UNIT, 1.0, 1),
        _load("x", 0, 4 * UNIT, 1.0, 1),
        _load("b", 0, 6 * UNIT, 1.0, 6),
    ]
    assert plan(loads, c_max=1.0, roofline_batch=10) == [Move("a", "x", 0), Move("s", "b", 0)]


def test_candidate_rules():
    kw = dict(c_max=0.9, roofline_batch=10)
    assert is_candidate(_load("x", 0, 0.5, 0.6, 3), **kw)
    assert not is_candidate(_load("x", 0, 0.5, 0.5, 3), **kw)  # not falling (strict)
    assert not is_candidate(_load("x", 0, 0.9, 1.0, 3), **kw)  # at C_max
    assert not is_candidate(_load("x", 0, 0.5, 0.6, 10), **kw)  # N_reqs == B
    assert not is_candidate(_load("x", 0, 0.0, 0.6, 0), **kw)  # nothing to move


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="kv_used"):
        _load("x", 0, -0.1, 0.2, 1)
    with pytest.raises(ValueError, match="num_running"):
        _load("x", 0, 0.1, 0.2, -1)
    with pytest.raises(ValueError, match="version"):
        _load("x", 1.5, 0.1, 0.2, 1)
    with pytest.raises(ValueError, match="kv_prev"):
        _load("x", 0, 0.1, float("nan"), 1)
    with pytest.raises(ValueError, match="'x' appears more than once"):
        plan([_load("x", 0, 0.1, 0.2, 1)] * 2, c_max=1.0, roofline_batch=4)
    with pytest.raises(ValueError, match="c_max"):
        plan([], c_max=0.0, roofline_batch=4)
    with pytest.raises(ValueError, match="roofline_batch"):
        plan([], c_max=1.0, roofline_batch=0)


def test_numpy_scalars_accepted():
    # The simulator keeps fleet state in numpy arrays; its scalars must pass validation.
    np = pytest.importorskip("numpy")
    loads = [
        RolloutLoad("a", np.int64(2), np.float64(0.25), np.float32(0.5), np.int32(3)),
        RolloutLoad("b", np.int64(2), np.float64(0.5), np.float32(0.75), np.int32(4)),
    ]
    assert plan(loads, c_max=np.float64(1.0), roofline_batch=np.int64(8)) == [Move("a", "b", 2)]
