"""The step breakdown's arithmetic, the progress line's length and step number, the start-up clock."""
import time

import numpy as np
import pytest

from laminar_jax.runtime import breakdown, progress


def test_learner_parts_and_unaccounted_add_up_to_the_wall():
    sw = breakdown.Stopwatch()
    sw.times.update(wait_data_s=0.5, batch_s=0.1, logprob_s=0.2, update_s=1.0, publish_s=0.05)
    out = sw.learner_step(wall=2.0, gap=0.15, checkpoint=0.1)
    assert out["time/checkpoint_s"] == 0.1 and out["time/rpc_gap_s"] == pytest.approx(0.05)
    parts = sum(out[f"time/{k}"] for k in breakdown.LEARNER_PARTS)
    assert parts + out["time/unaccounted_s"] == pytest.approx(2.0)
    assert out["time/unaccounted_s"] == pytest.approx(2.0 - 2.0)


def test_stopwatch_add_accumulates_and_returns_the_new_clock():
    sw = breakdown.Stopwatch()
    t0 = time.perf_counter()
    time.sleep(0.01)
    t1 = sw.add("update_s", t0)
    sw.add("update_s", t1)
    assert sw.times["update_s"] >= 0.01 and t1 > t0


def test_rollout_split_fractions_sum_to_one_and_average_over_rollouts():
    a = dict(busy_s=3.0, idle_s=1.0, decode_s=2.0, pull_s=0.2, reload_s=0.2, rpc_s=0.4, reward_s=0.0, wait_s=0.8)
    b = dict(busy_s=1.0, idle_s=1.0, decode_s=2.0, pull_s=0.0, reload_s=0.0, rpc_s=0.0, reward_s=0.0, wait_s=0.0)
    out = breakdown.rollout_split([a, b, dict(busy_s=0.0, idle_s=0.0)])   # the empty one is skipped
    assert sum(out.values()) == pytest.approx(1.0)
    assert out["time/rollout_decode_frac"] == pytest.approx((0.5 + 1.0) / 2)
    assert out["time/rollout_other_frac"] == pytest.approx((0.4 / 4.0 + 0.0) / 2)


def test_overhead_counts_at_most_the_rollouts_decode_seconds_of_the_wait_as_useful():
    m = {"time/step_wall_s": 4.0, "time/wait_data_s": 2.0, "time/update_s": 1.0, "time/logprob_s": 0.5,
         "time/rollout_decode_frac": 0.375}          # sync-like: 1.5 s of decode, all inside the wait
    out = breakdown.overhead(m)
    assert out["time/wait_decode_s"] == pytest.approx(1.5)
    assert out["time/wait_rollout_overhead_s"] == pytest.approx(0.5)
    assert out["time/overhead_s"] == pytest.approx(4.0 - 1.5 - 1.5)
    assert out["time/overhead_frac"] == pytest.approx(1.0 / 4.0)
    busy = breakdown.overhead(dict(m, **{"time/rollout_decode_frac": 0.95}))   # rollouts always decoding
    assert busy["time/wait_decode_s"] == pytest.approx(2.0) and busy["time/overhead_s"] == pytest.approx(0.5)


def test_relay_times_per_version():
    ev = [{"kind": "master_restored", "version": 1, "read_s": 0.1, "convert_s": 0.2, "checksum_s": 0.1},
          {"kind": "relay_received", "version": 1, "relay": "a", "forward_s": 0.05, "serve_s": 0.01, "bytes": 9},
          {"kind": "relay_received", "version": 1, "relay": "b", "recv_s": 0.3},
          {"kind": "master_restored", "version": 2, "read_s": 0.2, "convert_s": 0.0, "checksum_s": 0.0}]
    out = breakdown.relay_times(ev)
    assert out["time/relay_convert_s"] == pytest.approx(0.3)
    assert out["time/relay_chain_s"] == pytest.approx(0.3)
    assert breakdown.relay_times([]) == {}


def test_summarise_takes_means_after_the_compile_steps_so_the_parts_add_up():
    rows = [{"time/update_s": v, "time/step_wall_s": 2 * v, "time/overhead_s": v / 2, "time/unix_s": 1e9,
             "reward_mean": 0.0} for v in (30.0, 20.0, 1.0, 2.0, 6.0)]
    assert breakdown.summarise(rows) == {"update_s": 3.0, "step_wall_s": 6.0, "overhead_s": 1.5,
                                         "overhead_frac": 0.25}


def test_step_line_fits_and_shows_the_metrics_step():
    m = {"version": 12345, "reward_mean": 0.123456, "response_len_mean": 123456.7, "staleness_mean": 12.34,
         "staleness_max": 99, "tokens_per_s": 1e9, "gen_tokens_per_s": 1e9, "learner_idle_frac": 1.0,
         "rollout_idle_frac": 1.0, "time/step_wall_s": 12345.6, "time/overhead_frac": 0.5}
    line = progress.step_line(9999, 10000, m)
    assert len(line) <= progress.MAX_LINE
    assert line.startswith("step 9999/9999 v12345")   # the metrics' `step` column, 0-based
    assert progress.step_line(0, 60, dict(m, version=1)).startswith("step    0/59 v1 ")


def test_startup_clock_records_keyed_phases_and_prints_every_one():
    said = []
    clock = progress.StartupClock(said.append, t0=time.time() - 2.0)
    clock.mark("ray", "ray up")
    clock.mark(None, "printed only")
    assert list(clock.phases) == ["ray_s"] and 2.0 <= clock.phases["ray_s"] < 10.0
    assert said[0].startswith("start-up   2.") and said[0].endswith("ray up") and len(said) == 2


def test_summary_carries_the_breakdown():
    rows = [{"reward_mean": 0.5, "staleness_mean": 0.0, "staleness_max": 0, "consumed_trajectories": 8,
             "tokens_per_s": 1.0, "time/step_wall_s": w, "time/update_s": 0.5 * w, "time/overhead_frac": 0.1}
            for w in (9.0, 9.0, 1.0, 1.0)]
    s = progress.summary(rows, wall_s=20.0, accounting={}, counters={})
    assert s["breakdown"] == {"step_wall_s": 1.0, "update_s": 0.5, "overhead_frac": 0.1}
    assert "mean step 1.000 s" in progress.breakdown_text(s["breakdown"])
    assert np.isfinite(s["wall_s"])
