"""The simulator's statistics (laminar_jax/sim/stats.py): closed forms on hand-made snapshots."""
import math

import numpy as np
import pytest

from laminar_jax.sim import stats


def _snap(time, busy, kv, gen_tokens, alive, gen_role=0.0, learner=0.0):
    return dict(time=time, busy=busy, kv=kv, gen_tokens=gen_tokens, alive=alive, gen_role=gen_role, learner=learner)


def test_percentile_sorted_equals_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 300):
        values = sorted(rng.random(n).tolist())
        for q in (0.0, 10.0, 50.0, 90.0, 100.0):
            assert stats.percentile_sorted(values, q) == pytest.approx(np.percentile(values, q))


def test_interval_stats_disaggregated_by_hand():
    # 10 s; 4 rollouts alive all along (40 rollout-s), 30 of them generating; tp 2; learner busy 6 s
    # on 8 accelerators out of 16 in all; KV integral 20 share-s; 5000 tokens.
    a = _snap(100.0, 50.0, 10.0, 1000, 400.0, learner=30.0)
    b = _snap(110.0, 80.0, 30.0, 6000, 440.0, learner=36.0)
    s = stats.interval_stats(a, b, colocated=False, rollout_tp=2, accelerators=16, train_accelerators=8,
                             num_rollouts=4)
    assert s["rollout_idle_frac"] == pytest.approx(1 - 30 / 40)
    assert s["learner_idle_frac"] == pytest.approx(1 - 6 / 10)
    assert s["accelerator_idle_frac"] == pytest.approx(((40 - 30) * 2 + (10 - 6) * 8) / (16 * 10))
    assert s["kv_use"] == pytest.approx(20 / 40)
    assert s["gen_tokens_per_s"] == pytest.approx(500.0)


def test_interval_stats_colocated_by_hand():
    # colocated: the accelerators were rollouts for 4 of 10 s; 3 rollouts -> 12 rollout-s, 9 busy
    a = _snap(0.0, 0.0, 0.0, 0, 0.0, gen_role=0.0)
    b = _snap(10.0, 9.0, 6.0, 900, 30.0, gen_role=4.0)
    s = stats.interval_stats(a, b, colocated=True, rollout_tp=1, accelerators=3, train_accelerators=3,
                             num_rollouts=3)
    assert s["rollout_idle_frac"] == pytest.approx(1 - 9 / 12)
    assert s["learner_idle_frac"] == 0.0
    assert s["accelerator_idle_frac"] == pytest.approx((12 - 9) / (3 * 10))
    assert s["kv_use"] == pytest.approx(6 / 12)


def test_interval_stats_of_an_empty_interval_is_nan_not_an_error():
    a = _snap(5.0, 1.0, 1.0, 10, 2.0)
    s = stats.interval_stats(a, a, colocated=False, rollout_tp=1, accelerators=2, train_accelerators=1,
                             num_rollouts=1)
    assert math.isnan(s["rollout_idle_frac"]) and math.isnan(s["kv_use"]) and s["gen_tokens_per_s"] == 0.0


def _row(i, occ=4, stale=1.0, throughput=100.0):
    return dict(step=i + 1, throughput=throughput, iteration_s=2.0, buffer_groups=occ, held_groups=0,
                staleness_mean=stale, staleness_max=int(stale) + 1, rollout_idle_frac=0.1,
                learner_idle_frac=float("nan") if i == 0 else 0.2, accelerator_idle_frac=0.3, kv_use=0.5,
                gen_tokens_per_s=50.0)


def test_steady_state_flat_rows_are_steady_and_a_growing_buffer_is_not():
    flat = [_row(i) for i in range(10)]
    s = stats.steady_state(flat, warmup_steps=2, capacity=8)
    assert s == {"steady": True, "occupancy_drift": pytest.approx(0.0, abs=1e-9),
                 "staleness_drift": pytest.approx(0.0, abs=1e-9)}
    growing = [_row(i, occ=2 * i) for i in range(10)]      # +2 groups per update over 7 updates
    s = stats.steady_state(growing, warmup_steps=2, capacity=8)
    assert s["occupancy_drift"] == pytest.approx(2 * 7 / 8) and not s["steady"]
    rising = [_row(i, stale=float(i)) for i in range(10)]   # staleness +1 per update
    s = stats.steady_state(rising, warmup_steps=2, capacity=8)
    assert s["staleness_drift"] == pytest.approx(7.0) and not s["steady"]


def test_summarise_means_over_measured_rows_skip_nan_and_warmup():
    rows = [_row(0, throughput=1.0)] + [_row(i, throughput=100.0 + i) for i in range(1, 5)]
    s = stats.summarise(rows, warmup_steps=1)
    assert s["measured_steps"] == 4 and s["steps"] == 5
    assert s["throughput"] == pytest.approx(np.mean([101, 102, 103, 104]))
    assert s["learner_idle_frac"] == pytest.approx(0.2)
    rows[1]["learner_idle_frac"] = float("nan")                 # NaN rows are left out of a mean
    assert stats.summarise(rows, warmup_steps=1)["learner_idle_frac"] == pytest.approx(0.2)
    assert math.isnan(stats.summarise(rows, warmup_steps=5)["throughput"])
