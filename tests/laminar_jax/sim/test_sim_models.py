"""Physical models of the simulator: closed forms against brute force and hand computations."""
import math

import numpy as np
import pytest

from laminar_jax.config_loader import ConfigError, config_from_dict
from laminar_jax.sim import models
from laminar_jax.sim.config import (DecodeProfile, LengthDist, SimConfig, ToolSpec, TrainerModel,
                                    WeightsModel)
from laminar_jax.weights import chain

FIG4_7B_TP1 = dict(tp=1, batch=(1, 4, 8, 16, 32, 64, 128, 256),
                   latency_ms=(7.0, 7.3, 7.7, 8.4, 9.6, 12.6, 18.1, 29.6),
                   kv_capacity_tokens=1_100_000, prefill_tokens_per_s=30000.0)


def test_decode_reproduces_the_measured_curve_at_its_context():
    dm = models.DecodeModel(DecodeProfile(**FIG4_7B_TP1, kv_share=0.7), 1024)
    for n, ms in zip(FIG4_7B_TP1["batch"], FIG4_7B_TP1["latency_ms"]):
        assert dm.step_latency(n, n * 4096) == pytest.approx(ms * 1e-3)
    # beyond the last point: the last segment's slope
    slope = (29.6 - 18.1) / 128
    assert dm.step_latency(512, 512 * 4096) == pytest.approx((29.6 + slope * 256) * 1e-3)
    # the KV share scales with context: half the context saves kv_share of half the growth
    growth = (29.6 - 7.0) * 1e-3
    assert dm.step_latency(256, 256 * 2048) == pytest.approx(29.6e-3 - 0.7 * growth / 2)


@pytest.mark.parametrize("share,compute,over,add", [(0.99, 3.07e-5, 1.0, 0.0),
                                                     (0.5, 0.0, 1.3, 0.013),
                                                     (0.0, 1e-4, 1.0, 0.0)])
def test_decode_closed_form_sums_and_inverse(share, compute, over, add):
    dm = models.DecodeModel(DecodeProfile(**FIG4_7B_TP1, kv_share=share,
                                          compute_s_per_token=compute), 1024,
                            overhead=over, step_overhead_s=add)
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 1025))
        k = int(rng.integers(0, 1_100_000))
        s = int(rng.integers(0, 2000))
        brute = math.fsum(dm.step_latency(n, k + n * i) for i in range(s))
        assert dm.steps_time(n, k, s) == pytest.approx(brute, rel=1e-9, abs=1e-12)
        dt = float(rng.uniform(0, 1.5)) * max(brute, 1e-3)
        m = dm.steps_within(n, k, dt)
        assert dm.steps_time(n, k, m) <= dt < dm.steps_time(n, k, m + 1)


def test_decode_roofline_floor_and_overheads():
    prof = DecodeProfile(**FIG4_7B_TP1, kv_share=0.99, compute_s_per_token=3e-5)
    dm = models.DecodeModel(prof, 1024, overhead=1.5, step_overhead_s=0.01)
    # 1024 short sequences: compute-bound at 1024 * 30 us
    assert dm.step_latency(1024, 1024 * 100) == pytest.approx(1.5 * 1024 * 3e-5 + 0.01)
    # one sequence: the measured batch-1 latency
    assert dm.step_latency(1, 4096) == pytest.approx(1.5 * 7.0e-3 + 0.01)


def test_train_time_balances_sequences_over_groups():
    tm = TrainerModel(seconds_per_token=1e-3, sp=2, minibatch_overhead_s=0.5, step_overhead_s=1.0)
    tokens = np.array([8000, 1000, 1000, 1000, 3000, 3000])
    # 4 accelerators / sp 2 = 2 groups; LPT: {8000}, {3000, 3000, 1000, 1000, 1000} -> 9000
    assert models.minibatch_time(tokens, accelerators=4, model=tm) == pytest.approx(
        9000 * 1e-3 / 2 + 0.5)
    # two mini-batches of 3: {8000 | 1000, 1000} -> 8000; {1000, 3000 | 3000} -> 4000
    assert models.train_time(tokens, accelerators=4, model=tm, mini_batch=3) == pytest.approx(
        1.0 + (8000 + 4000) * 1e-3 / 2 + 2 * 0.5)
    # one group: every token in sequence
    assert models.minibatch_time(tokens, accelerators=2, model=tm) == pytest.approx(
        17000 * 1e-3 / 2 + 0.5)


def test_weight_transfer_models():
    w = WeightsModel(bytes=65.5e9, t_byte_s=5.84e-12, t_start_s=4.4e-4, pcie_bytes_per_s=30e9,
                     global_sync_s=0.8, global_sync_per_doubling_s=0.0425,
                     global_sync_ref_accelerators=32)
    assert models.pull_time(w, 4) == pytest.approx(65.5e9 / 120e9)
    assert models.global_sync_time(w, 32) == pytest.approx(0.8)
    assert models.global_sync_time(w, 512) == pytest.approx(0.8 + 4 * 0.0425)
    # the chain time model of laminar_jax.weights.chain, with its optimal chunk count
    p = 128
    k = chain.optimal_chunks(p, 65.5e9, 5.84e-12, 4.4e-4, max_chunks=1 << 16)
    assert models.relay_arrival(w, p - 1, p) == pytest.approx(
        chain.broadcast_time(p, k, 65.5e9, 5.84e-12, 4.4e-4))
    assert models.relay_arrival(w, 0, p) == 0.0
    # Fig 18 of the paper: 32B to 127 relays in ~0.73 s
    assert models.relay_arrival(w, p - 1, p) == pytest.approx(0.73, abs=0.02)


def test_length_sampling():
    rng = np.random.default_rng(0)
    d = LengthDist(kind="lognormal", median=1000, sigma=1.0, maximum=4000, minimum=10)
    x = models.sample_lengths(d, rng, 2000, 4)
    assert x.min() >= 10 and x.max() == 4000
    assert np.median(x) == pytest.approx(1000, rel=0.05)
    same = models.sample_lengths(LengthDist(median=500, sigma=0.8, group_share=1.0),
                                 rng, 50, 8).reshape(50, 8)
    assert (same == same[:, :1]).all()          # fully shared within a group
    h = LengthDist(kind="histogram", edges=(0, 10, 20), weights=(1, 3))
    y = models.sample_lengths(h, rng, 5000, 1)
    assert np.mean(y > 10) == pytest.approx(0.75, abs=0.03)
    assert (models.sample_lengths(LengthDist(kind="fixed", median=77), rng, 3, 2) == 77).all()


def test_tool_calls_cut_the_response():
    rng = np.random.default_rng(0)
    resp = np.array([100, 1, 5000])
    calls = models.sample_tools(ToolSpec(max_calls=8, latency_max_s=30.0), rng, resp)
    for r, t in zip(resp, calls):
        if t is None:
            continue
        cuts, lat, out, failed = t
        assert cuts == sorted(cuts) and 0 < cuts[0] and cuts[-1] < r and len(cuts) <= 8
        assert all(0 < x <= 30.0 for x in lat) and out == 200 and not any(failed)
    assert calls[1] is None     # a 1-token response cannot call a tool


def test_tool_call_counts_latency_kinds_and_failures():
    rng = np.random.default_rng(1)
    resp = np.full(4000, 500)
    # calls_weights: P(0), P(1), P(2) calls
    got = models.sample_tools(ToolSpec(max_calls=2, calls_weights=(0.5, 0.0, 0.5)), rng, resp)
    counts = np.array([0 if t is None else len(t[0]) for t in got])
    assert set(counts.tolist()) == {0, 2} and np.mean(counts == 2) == pytest.approx(0.5, abs=0.03)
    lat = lambda spec: np.concatenate([t[1] for t in models.sample_tools(spec, rng, resp) if t])  # noqa: E731
    assert (lat(ToolSpec(max_calls=3, latency_kind="fixed", latency_median_s=2.5)) == 2.5).all()
    exp = lat(ToolSpec(max_calls=3, latency_kind="exponential", latency_median_s=2.0, latency_max_s=1e9))
    assert np.median(exp) == pytest.approx(2.0, rel=0.06) and exp.std() == pytest.approx(exp.mean(), rel=0.06)
    # failures: a share failure_prob of calls hangs until timeout_s
    spec = ToolSpec(max_calls=4, latency_kind="fixed", latency_median_s=1.0, failure_prob=0.25, timeout_s=9.0)
    calls = [t for t in models.sample_tools(spec, rng, resp) if t]
    failed = np.concatenate([t[3] for t in calls])
    lats = np.concatenate([t[1] for t in calls])
    assert failed.mean() == pytest.approx(0.25, abs=0.02)
    assert (lats[failed] == 9.0).all() and (lats[~failed] == 1.0).all()
    with pytest.raises(ValueError, match="calls_weights"):
        ToolSpec(max_calls=2, calls_weights=(1.0, 1.0))
    with pytest.raises(ValueError, match="latency_kind"):
        ToolSpec(latency_kind="pareto")


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="kv_share: expected 0 <= kv_share <= 1, got 1.5"):
        DecodeProfile(**FIG4_7B_TP1, kv_share=1.5)
    with pytest.raises(ValueError, match="batch: expected strictly increasing"):
        DecodeProfile(**{**FIG4_7B_TP1, "batch": (1, 4, 4, 16, 32, 64, 128, 256)})
    base = {"model": {"name": "m", "decode": [dict(FIG4_7B_TP1)],
                      "trainer": {"seconds_per_token": 1e-4}, "weights": {"bytes": 1e9}},
            "systems": [{"name": "a", "mode": "laminar", "repack": True}],
            "cells": [{"system": "a", "accelerators": 4, "train": 2, "rollout": 2}]}
    assert config_from_dict(base, schema=SimConfig).system("a").repack
    with pytest.raises(ConfigError, match="repack"):
        config_from_dict({**base, "systems": [{"name": "a", "mode": "sync", "repack": True}]},
                         schema=SimConfig)
    with pytest.raises(ConfigError, match="train \\+ rollout == accelerators"):
        config_from_dict({**base, "cells": [{"system": "a", "accelerators": 5, "train": 2,
                                             "rollout": 2}]}, schema=SimConfig)
    with pytest.raises(ConfigError, match="no profile for tp=2"):
        config_from_dict({**base, "systems": [{"name": "a", "mode": "laminar", "rollout_tp": 2}]},
                         schema=SimConfig)


def test_every_scenario_loads_and_studies_inherit_their_base(tmp_path):
    from laminar_jax.sim.config import load_sim_config

    root = __import__("pathlib").Path(__file__).resolve().parents[3] / "configs" / "sim"
    for path in sorted(root.glob("*.yaml")):
        cfg = load_sim_config(path)
        assert cfg.selected_cells(), path
    study = load_sim_config(root / "study_repack.yaml", ["run.measure_steps=3"])
    base = load_sim_config(root / "paper_32b_math.yaml")
    assert study.model == base.model and study.workload == base.workload
    assert [s.repack for s in study.systems] == [True, False]
    assert study.run.measure_steps == 3 and study.run.global_batch == base.run.global_batch
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="include each other"):
        load_sim_config(tmp_path / "a.yaml")
