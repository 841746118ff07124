"""Tests for weights/chain.py: relay chain plan and broadcast time model (Laminar §4, App. D)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar_jax.weights.chain import (
    Transfer,
    arrival_time,
    broadcast_time,
    chain_order,
    chunk_bounds,
    chunk_schedule,
    chunk_time,
    links,
    optimal_chunks,
    relink,
)

# ---------------------------------------------------------------------------------------------
# Topology


def test_chain_order_puts_master_first_and_keeps_order():
    assert chain_order(["n0", "n1", "n2", "n3"], "n2") == ("n2", "n0", "n1", "n3")
    assert chain_order(["solo"], "solo") == ("solo",)
    with pytest.raises(ValueError, match="master 'x' is not among the nodes"):
        chain_order(["a", "b"], "x")
    with pytest.raises(ValueError, match="repeated: 'a'"):
        chain_order(["a", "b", "a"], "a")


@st.composite
def chains_and_removals(draw):
    nodes = draw(
        st.lists(
            st.text("abcdefghij", min_size=1, max_size=3), min_size=1, max_size=30, unique=True
        )
    )
    master = draw(st.sampled_from(nodes))
    order = chain_order(nodes, master)
    removals = draw(st.permutations(order))
    count = draw(st.integers(0, len(order)))
    return nodes, master, order, list(removals[:count])


@settings(max_examples=200, deadline=None)
@given(chains_and_removals())
def test_relink_keeps_every_live_relay_once_and_touches_only_neighbours(case):
    nodes, master, order, removals = case
    live = set(nodes)
    for removed in removals:
        before = links(order)
        upstream, downstream = before[removed]
        new_order = relink(order, removed)
        live.discard(removed)
        assert sorted(new_order) == sorted(live)
        assert len(set(new_order)) == len(new_order)
        after = links(new_order)
        assert removed not in after
        changed = {n for n in after if after[n] != before[n]}
        assert changed <= {upstream, downstream} - {None}
        if upstream is not None and downstream is not None:
            assert after[upstream][1] == downstream and after[downstream][0] == upstream
        if upstream is None and downstream is not None:
            # The master left: the next node in the chain is promoted, fed by the learner.
            assert new_order[0] == downstream and after[downstream][0] is None
        if downstream is None and upstream is not None:
            assert after[upstream][1] is None
        order = new_order
    assert len(order) == len(live)


def test_relink_master_promotes_next_in_chain():
    order = chain_order(["m", "a", "b", "c"], "m")
    assert relink(order, "m") == ("a", "b", "c")
    assert relink(relink(order, "m"), "a") == ("b", "c")
    assert relink(order, "b") == ("m", "a", "c")
    assert relink(("m",), "m") == ()
    assert links(("m", "a", "b")) == {"m": (None, "a"), "a": ("m", "b"), "b": ("a", None)}
    with pytest.raises(ValueError, match="node 'z' is not in the chain"):
        relink(order, "z")


# ---------------------------------------------------------------------------------------------
# Time model

# Paper-scale numbers [P App. D]: a 70B model in BF16 (140 GB), 100 GB/s per hop, 5 us startup.
M70 = 140e9
T_BYTE = 1 / 100e9
T_START = 5e-6


def test_broadcast_time_closed_forms():
    # p = 2: one hop, T = k * (M/k * T_byte + T_start) = M*T_byte + k*T_start.
    for k in (1, 2, 7):
        assert broadcast_time(2, k, 1000.0, 0.01, 0.5) == pytest.approx(10.0 + 0.5 * k)
    # p = 3, k = 1 (store and forward): two full hops.
    assert broadcast_time(3, 1, 1000.0, 0.01, 0.5) == pytest.approx(2 * (10.0 + 0.5))
    # p = 4, k = 2: 4 steps of (500 * 0.01 + 0.5) = 5.5 s.
    assert broadcast_time(4, 2, 1000.0, 0.01, 0.5) == pytest.approx(22.0)
    # Expanded form of App. D.
    p, k = 128, 300
    expanded = M70 * T_BYTE + (p - 2) * T_START + k * T_START + (p - 2) * M70 * T_BYTE / k
    assert broadcast_time(p, k, M70, T_BYTE, T_START) == pytest.approx(expanded, rel=1e-12)
    # Master alone: nothing to send.
    assert broadcast_time(1, 1, M70, T_BYTE, T_START) == 0.0
    assert broadcast_time(1, 9, M70, T_BYTE, T_START) == 0.0


def test_arrival_time_matches_broadcast_time_and_chunk_time():
    for p in range(1, 9):
        for k in (1, 3, 10):
            assert arrival_time(p - 1, k, 1000.0, 0.01, 0.5) == pytest.approx(
                broadcast_time(p, k, 1000.0, 0.01, 0.5)
            )
    assert arrival_time(0, 4, 1000.0, 0.01, 0.5) == 0.0
    # Node 3 of the chain with 4 chunks: steps 3..6 carry its chunks, so 6 steps in all.
    t_chunk = chunk_time(4, 1000.0, 0.01, 0.5)
    assert t_chunk == pytest.approx(250 * 0.01 + 0.5)
    assert arrival_time(3, 4, 1000.0, 0.01, 0.5) == pytest.approx(6 * t_chunk)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 3000),
    st.floats(1e3, 1e12),
    st.floats(1e-12, 1e-6),
    st.floats(1e-7, 1e-2),
)
def test_optimal_chunks_is_the_integer_argmin(p, model_bytes, t_byte, t_start):
    k = optimal_chunks(p, model_bytes, t_byte, t_start)
    assert isinstance(k, int) and k >= 1

    def t(kk):
        return broadcast_time(p, kk, model_bytes, t_byte, t_start)

    if p <= 2:
        assert k == 1
        return
    k_star = math.sqrt((p - 2) * model_bytes * t_byte / t_start)
    cap = math.floor(model_bytes)  # at least one byte per chunk
    # The closed form, within rounding: k is floor(k*) or ceil(k*), clipped to [1, cap] ...
    assert k in {min(cap, max(1, math.floor(k_star))), min(cap, max(1, math.ceil(k_star)))}
    # ... and no integer near it does better (T is convex in k, so this is the global argmin).
    for other in {1, k - 1, k + 1, math.floor(k_star), math.ceil(k_star), 2 * k}:
        if 1 <= other <= cap:
            assert t(k) <= t(other) * (1 + 1e-12)
    # T(k) - T*(p) = T_start * (k - k*)^2 / k, below T_start when |k - k*| < 1: the integer
    # optimum is within one startup time of the real optimum of App. D.
    t_star = model_bytes * t_byte + (p - 2) * t_start + 2 * math.sqrt(
        (p - 2) * model_bytes * t_byte * t_start
    )
    assert t(k) >= t_star * (1 - 1e-12)
    gap = t_start * (k - k_star) ** 2 / k
    assert t(k) - t_star == pytest.approx(gap, rel=1e-6, abs=1e-12 * t_star)
    if k_star <= cap:
        assert t(k) <= t_star + t_start + 1e-12 * t_star


def test_optimal_chunks_brute_force_small():
    for p in range(1, 40):
        for model_bytes, t_byte, t_start in [(1e3, 0.01, 0.5), (5e4, 1e-3, 0.02), (77.0, 1.0, 3.0)]:
            k = optimal_chunks(p, model_bytes, t_byte, t_start)
            times = {
                kk: broadcast_time(p, kk, model_bytes, t_byte, t_start) for kk in range(1, 400)
            }
            best = min(times.values())
            assert times[k] == pytest.approx(best, rel=1e-12)
            # Ties go to the fewest chunks.
            assert k == min(kk for kk, v in times.items() if v <= best * (1 + 1e-12))


def test_optimal_chunks_caps_and_edges():
    # No startup cost: more chunks always help; capped by one byte per chunk, or max_chunks.
    assert optimal_chunks(10, 5000.0, 0.01, 0.0) == 5000
    assert optimal_chunks(10, 5000.0, 0.01, 0.0, max_chunks=64) == 64
    # k* = sqrt(8 * 1000 * 0.01 / 0.05) = 40, above a cap of 16.
    assert optimal_chunks(10, 1000.0, 0.01, 0.05, max_chunks=16) == 16
    assert optimal_chunks(10, 1000.0, 0.01, 0.05) == 40
    # k* = sqrt(12 * 1000 * 0.01 / 0.5) = sqrt(240): T(15) == T(16) exactly, fewer chunks win.
    assert optimal_chunks(14, 1000.0, 0.01, 0.5) == 15
    assert optimal_chunks(2, M70, T_BYTE, T_START) == 1
    assert optimal_chunks(1, M70, T_BYTE, T_START) == 1
    assert optimal_chunks(50, 0.0, T_BYTE, T_START) == 1
    # Paper scale: 128 relays, 140 GB. k* = sqrt(126 * 1.4 / 5e-6) ~ 5940 chunks of ~24 MB,
    # and the broadcast takes ~1.46 s, the order of the 1.6 s the paper measures for 72B.
    k = optimal_chunks(128, M70, T_BYTE, T_START)
    assert abs(k - math.sqrt(126 * 1.4 / 5e-6)) <= 1
    assert 1.4 < broadcast_time(128, k, M70, T_BYTE, T_START) < 1.5


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"broadcast_time: p must be an int >= 1, got 0"):
        broadcast_time(0, 1, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"k must be an int >= 1, got 2.5"):
        broadcast_time(3, 2.5, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"t_start must be a finite number >= 0"):
        optimal_chunks(3, 1.0, 1.0, -1.0)
    with pytest.raises(ValueError, match=r"max_chunks"):
        optimal_chunks(3, 1.0, 1.0, 1.0, max_chunks=0)
    with pytest.raises(ValueError, match=r"model_bytes"):
        chunk_time(1, float("inf"), 1.0, 1.0)


# ---------------------------------------------------------------------------------------------
# Schedule


@pytest.mark.parametrize("p", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_chunk_schedule_is_a_valid_pipeline_of_length_T(p, k):
    schedule = chunk_schedule(p, k)
    # Length in steps times t_chunk is the broadcast time.
    t_chunk = chunk_time(k, 1000.0, 0.01, 0.5)
    assert len(schedule) * t_chunk == pytest.approx(broadcast_time(p, k, 1000.0, 0.01, 0.5))
    have = {0: set(range(k))} | {j: set() for j in range(1, p)}
    received_at = {}
    for step, transfers in enumerate(schedule):
        senders = [t.sender for t in transfers]
        receivers = [t.receiver for t in transfers]
        # One port each way per node per step; only downstream hops.
        assert len(set(senders)) == len(senders) and len(set(receivers)) == len(receivers)
        arrivals = []
        for t in transfers:
            assert t.receiver == t.sender + 1 and 0 <= t.chunk < k
            assert t.chunk in have[t.sender], f"step {step}: {t} forwards a chunk it does not hold"
            assert t.chunk not in have[t.receiver], f"step {step}: {t} resends a chunk"
            arrivals.append(t)
        for t in arrivals:  # a chunk received in this step can be forwarded only in the next
            have[t.receiver].add(t.chunk)
            received_at[(t.receiver, t.chunk)] = step
    assert all(have[j] == set(range(k)) for j in range(p))
    # Chunks arrive in order, and each node is complete exactly at arrival_time.
    for j in range(1, p):
        steps = [received_at[(j, c)] for c in range(k)]
        assert steps == sorted(steps)
        assert (steps[-1] + 1) * t_chunk == pytest.approx(arrival_time(j, k, 1000.0, 0.01, 0.5))


def test_chunk_schedule_small_by_hand():
    # p = 3, k = 2: step 0 m->1 c0; step 1 m->1 c1 and 1->2 c0; step 2 1->2 c1.
    assert chunk_schedule(3, 2) == (
        (Transfer(0, 1, 0),),
        (Transfer(0, 1, 1), Transfer(1, 2, 0)),
        (Transfer(1, 2, 1),),
    )
    assert chunk_schedule(1, 5) == ()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**9), st.integers(1, 1000))
def test_chunk_bounds_tile_the_buffer(model_bytes, k):
    if k > max(model_bytes, 1):
        with pytest.raises(ValueError, match="chunk_bounds"):
            chunk_bounds(model_bytes, k)
        return
    bounds = chunk_bounds(model_bytes, k)
    assert len(bounds) == k
    assert bounds[0][0] == 0 and bounds[-1][1] == model_bytes
    assert all(bounds[c][1] == bounds[c + 1][0] for c in range(k - 1))
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= (1 if model_bytes else 0)
    assert model_bytes == 0 or min(sizes) >= 1
