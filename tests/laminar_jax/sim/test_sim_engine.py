"""Simulator mechanics: closed-form tiny scenarios, mode equivalences, invariants, run folders."""
import math

import numpy as np
import pytest

from laminar_jax.config_loader import config_from_dict
from laminar_jax.sim.config import SimConfig
from laminar_jax.sim.engine import Sim

# Flat decode curve: every step takes 10 ms whatever the batch; prefill 1000 tokens/s.
FLAT = {"tp": 1, "batch": [1, 2], "latency_ms": [10.0, 10.0], "kv_capacity_tokens": 1_000_000,
        "prefill_tokens_per_s": 1000.0, "kv_share": 0.0}


def tiny(systems, cells, **over):
    """A small scenario: fixed prompt 100 / response 1000 tokens, groups of 4, batch of 8."""
    data = {
        "name": "tiny",
        "seed": 0,
        "model": {
            "name": "toy",
            "decode": [FLAT],
            "trainer": {"seconds_per_token": 1e-3, "sp": 1, "minibatch_overhead_s": 0.5},
            "weights": {"bytes": 2e9, "pcie_bytes_per_s": 1e9, "global_sync_s": 2.0,
                        "global_sync_ref_accelerators": 1},
        },
        "workload": {"group_size": 4, "prompt": {"kind": "fixed", "median": 100},
                     "response": {"kind": "fixed", "median": 1000}},
        "cluster": {"kv_reserve_tokens": 0},
        "run": {"global_batch": 8, "mini_batch": 8, "warmup_steps": 2, "measure_steps": 3,
                "write": False},
        "systems": systems,
        "cells": cells,
    }
    for key, value in over.items():
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return config_from_dict(data, schema=SimConfig)


def run(cfg, i=0):
    return Sim(cfg, cfg.cells[i]).run()


def steady_iteration(sim):
    return sim.steps[-1]["iteration_s"]


def test_sync_one_rollout_closed_form():
    cfg = tiny([{"name": "s", "mode": "sync"}], [{"system": "s", "accelerators": 2, "train": 1,
                                                 "rollout": 1}])
    sim = run(cfg)
    prefill, decode = 8 * 100 / 1000.0, 1000 * 0.010
    train = 8 * 1100 * 1e-3 + 0.5
    sync = 2.0
    assert sim.steps[0]["time"] == pytest.approx(prefill + decode + train)
    it = prefill + decode + train + sync
    for s in sim.steps[1:]:
        assert s["iteration_s"] == pytest.approx(it)
        assert s["throughput"] == pytest.approx(8 * 1100 / it)
        assert s["tokens"] == 8 * 1100
        # the rollout generates (prefill + decode) and waits for the learner and the sync
        assert s["rollout_idle_frac"] == pytest.approx((train + sync) / it)
        assert s["learner_idle_frac"] == pytest.approx(1 - train / it)
        assert s["accelerator_idle_frac"] == pytest.approx(
            ((train + sync) + (it - train)) / (2 * it))
        assert s["staleness_mean"] == 0 and s["staleness_max"] == 0
        # KV holds the 800 prompt tokens during prefill, then grows linearly to 8800 tokens
        # (sampling ticks split steps, hence the tolerance of a fraction of one step)
        kv_seconds = 800 * prefill + (800 + 8800) / 2 * decode
        assert s["kv_use"] == pytest.approx(kv_seconds / 1e6 / it, rel=1e-3)
    assert sim.summary()["throughput"] == pytest.approx(8 * 1100 / it)


def test_sync_colocated_equal_lengths_has_no_idle_rollout():
    cfg = tiny([{"name": "verl", "mode": "sync", "colocated": True}],
               [{"system": "verl", "accelerators": 4, "train": 4, "rollout": 4}],
               **{"run.global_batch": 16, "run.mini_batch": 16})
    sim = run(cfg)
    gen = 4 * 100 / 1000.0 + 1000 * 0.010         # each rollout: 4 sequences
    train = 4 * 1100 * 1e-3 + 0.5                  # 16 sequences over 4 accelerators
    for s in sim.steps:
        assert s["rollout_idle_frac"] == pytest.approx(0.0, abs=1e-12)
        assert s["learner_idle_frac"] == 0.0
    for s in sim.steps[1:]:
        assert s["iteration_s"] == pytest.approx(2.0 + gen + train)


@pytest.mark.parametrize("seconds_per_token,overhead", [(0.0, 0.0), (1e-3, 0.5)])
def test_laminar_one_rollout_equals_sync_and_one_step(seconds_per_token, overhead):
    systems = [{"name": "sync", "mode": "sync"}, {"name": "one_step", "mode": "one_step"},
               {"name": "laminar", "mode": "laminar", "relays": True, "max_concurrency": 8}]
    cells = [{"system": n, "accelerators": 2, "train": 1, "rollout": 1}
             for n in ("sync", "one_step", "laminar")]
    cfg = tiny(systems, cells, **{"model.trainer.seconds_per_token": seconds_per_token,
                                  "model.trainer.minibatch_overhead_s": overhead})
    sync, one_step, laminar = (run(cfg, i) for i in range(3))
    gen = 0.8 + 10.0
    # laminar's one rollout drains its batch, pulls the newest version (2 s, like the sync) and
    # starts the next one: the learner never holds it back, as in one_step
    assert steady_iteration(laminar) == pytest.approx(gen + 2.0)
    assert steady_iteration(one_step) == pytest.approx(gen + 2.0)
    train = 8 * 1100 * seconds_per_token + overhead
    assert steady_iteration(sync) == pytest.approx(gen + train + 2.0)
    if seconds_per_token == 0.0:
        assert laminar.summary()["throughput"] == pytest.approx(sync.summary()["throughput"])
    assert laminar.summary()["staleness_max"] == 1
    assert all(v == 1 for v in laminar.ts.versions[: len(laminar.consumed)])


def lognormal_cfg(systems, cells, seed=0, **over):
    over = {"workload.response": {"kind": "lognormal", "median": 600, "sigma": 1.0,
                                  "group_share": 0.3, "maximum": 8000},
            "workload.prompt": {"kind": "lognormal", "median": 100, "sigma": 0.3},
            "model.decode": [{"tp": 1, "batch": [1, 64, 256], "latency_ms": [7.0, 12.6, 29.6],
                              "kv_capacity_tokens": 200_000, "prefill_tokens_per_s": 30000.0,
                              "kv_share": 0.9, "compute_s_per_token": 3e-5}],
            "model.trainer.seconds_per_token": 2e-5,
            "run.global_batch": 256, "run.mini_batch": 64, "seed": seed, **over}
    return tiny(systems, cells, **over)


ALL = [{"name": "verl", "mode": "sync", "colocated": True},
       {"name": "one_step", "mode": "one_step"},
       {"name": "stream", "mode": "stream"},
       {"name": "areal", "mode": "partial", "max_concurrency": 128, "max_staleness": 1},
       {"name": "laminar", "mode": "laminar", "relays": True, "repack": True,
        "max_concurrency": 128}]
ALL_CELLS = [{"system": "verl", "accelerators": 8, "train": 8, "rollout": 8}] + [
    {"system": s, "accelerators": 8, "train": 4, "rollout": 4}
    for s in ("one_step", "stream", "areal", "laminar")]


def test_staleness_bounds_and_single_version_per_mode():
    cfg = lognormal_cfg(ALL, ALL_CELLS)
    sims = {c.system: run(cfg, i) for i, c in enumerate(cfg.cells)}
    assert {s["staleness_max"] for s in sims["verl"].steps} == {0}
    assert {s["staleness_max"] for s in sims["one_step"].steps[1:]} == {1}
    assert max(s["staleness_max"] for s in sims["stream"].steps) <= 1
    # partial: eta gates submissions (dropped groups do not count: they land in no batch);
    # interrupted long trajectories finishing later than eta allows are dropped by the buffer
    areal = sims["areal"]
    assert areal.policy.submitted - areal.buffer.dropped_trajectories <= (areal.version + 2) * 256
    assert max(s["staleness_max"] for s in areal.steps) <= 1
    for name in ("verl", "one_step", "stream", "laminar"):
        ts = sims[name].ts
        assert all(ts.versions[i] == 1 for i, _, _ in sims[name].consumed), name
    ts = sims["areal"].ts
    assert max(ts.versions[i] for i, _, _ in sims["areal"].consumed) > 1   # interrupted
    for sim in sims.values():   # every consumed trajectory finished, each exactly once
        ids = [i for i, _, _ in sim.consumed]
        assert len(ids) == len(set(ids))
        assert all(sim.ts.finish_t[i] >= 0 for i in ids)


def test_deterministic_with_a_seed():
    cells = [{"system": "laminar", "accelerators": 8, "train": 4, "rollout": 4}]
    a = run(lognormal_cfg(ALL, cells, seed=3))
    b = run(lognormal_cfg(ALL, cells, seed=3))
    c = run(lognormal_cfg(ALL, cells, seed=4))
    assert a.steps == b.steps and a.events == b.events and a.kv_samples == b.kv_samples
    assert [s["time"] for s in a.steps] != [s["time"] for s in c.steps]


def test_repack_moves_within_a_version_and_frees_sources():
    cells = [{"system": "laminar", "accelerators": 24, "train": 8, "rollout": 16}]
    sim = run(lognormal_cfg(ALL, cells, **{"repack.roofline_batch": 32, "run.measure_steps": 6}))
    moves = [e for e in sim.events if e["kind"] == "repack"]
    assert moves, "expected repack moves in a long-tailed workload"
    repacked = [i for i, _, _ in sim.consumed if sim.ts.repacks[i] > 0]
    assert repacked
    # a moved trajectory finishes on its generating version: it never spans versions
    assert all(sim.ts.versions[i] == 1 for i in repacked)
    pulls = {(e["rollout"], e["time"]) for e in sim.events if e["kind"] == "pull"}
    sources = {e["source"] for e in moves}
    assert sources & {r for r, _ in pulls}


def test_machine_failure_keeps_partials_and_recovers():
    systems = [dict(ALL[4])]
    cells = [{"system": "laminar", "accelerators": 24, "train": 8, "rollout": 16}]
    cfg = lognormal_cfg(systems, cells, **{"failures": [{"time_s": 20.0, "machine": 1,
                                                         "recovery_s": 30.0}],
                                           "cluster.accelerators_per_machine": 4,
                                           "run.measure_steps": 30, "run.sample_interval_s": 5.0})
    sim = run(cfg)
    kinds = [e["kind"] for e in sim.events]
    assert "failure" in kinds and "recovery" in kinds
    fail = next(e for e in sim.events if e["kind"] == "failure")
    assert fail["rollouts"] == [4, 5, 6, 7] and fail["time"] == 20.0
    alive = {round(s["time"]): s["alive_rollouts"] for s in sim.kv_samples}
    assert alive[15] == 16 and alive[25] == 12 and alive[55] == 16
    ids = [i for i, _, _ in sim.consumed]
    assert len(ids) == len(set(ids)) and all(sim.ts.finish_t[i] >= 0 for i in ids)
    assert all(sim.ts.versions[i] == 1 for i in ids)
    # the machine's rollouts generate again after recovery
    late = [i for i in range(len(sim.ts)) if sim.ts.first_rollout[i] in (4, 5, 6, 7)
            and sim.ts.start_t[i] > 50.0]
    assert late


def test_run_folder_roundtrip(tmp_path):
    from laminar_jax.analysis import load_run
    from laminar_jax.sim.report import write_run

    cells = [{"system": "laminar", "accelerators": 8, "train": 4, "rollout": 4}]
    sim = run(lognormal_cfg(ALL, cells))
    result = write_run(sim, tmp_path / "lam", tensorboard=False)
    loaded = load_run(tmp_path / "lam")
    assert len(loaded.metrics) == len(sim.steps)
    assert len(loaded.trajectories) == len(sim.consumed)
    assert (loaded.trajectories.staleness
            == loaded.trajectories.learner_version - loaded.trajectories.gen_version).all()
    assert loaded.config["cell"]["system"] == "laminar"
    summary = loaded.events[loaded.events.kind == "summary"].iloc[0]
    assert summary["throughput"] == pytest.approx(result.throughput)
    hist = {int(k): v for k, v in summary["staleness_hist"].items()}
    w = sim.cfg.run.warmup_steps
    measured = loaded.trajectories.iloc[sum(s["trajectories"] for s in sim.steps[:w]):]
    assert hist == measured.staleness.value_counts().to_dict()
    assert np.isclose(loaded.metrics.throughput.iloc[w:].mean(), result.throughput)
    assert not math.isnan(result.kv_use)


def test_cli_main_writes_run_folders(tmp_path, capsys):
    import yaml

    from laminar_jax.config_loader import dump_config
    from laminar_jax.sim import cli

    cells = [{"system": "one_step", "accelerators": 8, "train": 4, "rollout": 4,
              "paper_tokens_per_s": 1000.0}]
    cfg = lognormal_cfg(ALL, cells, **{"run.write": True, "run.out_dir": str(tmp_path)})
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(dump_config(cfg)))
    assert cli.main(str(path), ["run.measure_steps=2"]) == 0
    out = capsys.readouterr().out
    assert "one_step" in out and "sim / paper" in out
    assert (tmp_path / "tiny" / "one_step_8" / "metrics").is_dir()  # part files


def test_tool_calls_wait_free_the_kv_cache_and_add_their_output():
    cfg = tiny([{"name": "s", "mode": "sync"}],
               [{"system": "s", "accelerators": 2, "train": 1, "rollout": 1}],
               **{"workload.tools": {"max_calls": 3, "latency_median_s": 4.0,
                                     "latency_sigma": 0.0, "output_tokens": 50},
                  "run.warmup_steps": 0, "run.measure_steps": 2})
    sim = run(cfg)
    ts = sim.ts
    for i, _, _ in sim.consumed:
        calls = 0 if ts.tools[i] is None else len(ts.tools[i][0])
        assert ts.total_tokens(i) == 100 + 1000 + 50 * calls
        # 1000 decode steps of 10 ms plus one 4 s environment wait per call, at least
        assert ts.finish_t[i] - ts.start_t[i] >= 10.0 + 4.0 * calls - 1e-9
    assert any(ts.tools[i] is not None for i, _, _ in sim.consumed)
    # the batch's tokens count the tool outputs as response tokens
    first = [i for i, v, _ in sim.consumed if v == 0]
    assert sim.steps[0]["tokens"] == sum(ts.total_tokens(i) for i in first)


def test_sandbox_slots_queue_tool_calls_and_failed_calls_wait_their_timeout():
    """sandbox_slots: at most that many calls run at once (the rest queue, first come first
    served); failed calls hold their trajectory for timeout_s."""
    def tools(**kw):
        return {"max_calls": 2, "calls_weights": [0, 0, 1], "latency_kind": "fixed", "latency_median_s": 4.0,
                "output_tokens": 50, **kw}
    cell = [{"system": "s", "accelerators": 2, "train": 1, "rollout": 1}]
    over = {"run.warmup_steps": 0, "run.measure_steps": 2}
    free = run(tiny([{"name": "s", "mode": "sync"}], cell, **{"workload.tools": tools()}, **over))
    one = run(tiny([{"name": "s", "mode": "sync"}], cell, **{"workload.tools": tools(sandbox_slots=1)}, **over))
    assert max(free.ts.tool_wait) == 0.0
    # 8 trajectories x 2 calls of 4 s through one slot: 16 calls, one at a time (64 s), against
    # two calls each in parallel (8 s)
    assert one.steps[0]["time"] >= 16 * 4.0 and one.steps[0]["time"] > free.steps[0]["time"] + 30
    assert sum(one.ts.tool_wait[i] for i, _, _ in one.consumed) > 0
    from laminar_jax.sim.report import trajectory_columns
    cols = trajectory_columns(one)
    assert (cols["tool_wait_s"] > 0).any() and (cols["tool_failed"] == 0).all()
    failing = run(tiny([{"name": "s", "mode": "sync"}], cell,
                       **{"workload.tools": tools(failure_prob=1.0, timeout_s=20.0)}, **over))
    cols = trajectory_columns(failing)
    assert (cols["tool_failed"] == 2).all()
    for i, _, _ in failing.consumed:   # two 20 s timeouts instead of two 4 s calls
        assert failing.ts.finish_t[i] - failing.ts.start_t[i] >= 10.0 + 2 * 20.0 - 1e-9
