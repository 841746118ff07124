"""The repack study (configs/sim/study_repack.yaml) keeps the paper's direction and rough size,
and the repack KV transfer does what it says.

[P §8.4, Table 1, Fig 16]: with repack, average KV use rises from 71.6% to 82.2% and generation
throughput by 26%. The simulator reaches the KV figures and about +11% generation (docs/
simulator.md says why not more); the test holds KV use within 5 points of the paper's and the
generation gain above +8%, measured on simulated tokens, never on wall-clock time.
"""
import pathlib

import pytest

from laminar_jax.sim.config import load_sim_config
from laminar_jax.sim.engine import Sim

ROOT = pathlib.Path(__file__).resolve().parents[3]
STUDY = ROOT / "configs" / "sim" / "study_repack.yaml"


def summary(system, *overrides):
    cfg = load_sim_config(STUDY, ["run.warmup_steps=3", "run.measure_steps=6",
                                  f"run.only_systems=[{system}]", *overrides])
    sim = Sim(cfg, cfg.selected_cells()[0]).run()
    return sim, sim.summary()


@pytest.fixture(scope="module")
def study():
    return {name: summary(name) for name in ("repack", "no_repack")}


def test_repack_raises_kv_use_and_generation(study):
    (on_sim, on), (off_sim, off) = study["repack"], study["no_repack"]
    assert on["kv_use"] == pytest.approx(0.822, abs=0.05)      # Table 1 with repack
    assert off["kv_use"] == pytest.approx(0.716, abs=0.05)     # and without
    assert on["kv_use"] - off["kv_use"] > 0.07
    assert on["gen_tokens_per_s"] / off["gen_tokens_per_s"] > 1.08
    # trajectory latency is not what repack trades for it [Table 1: 290 vs 296 s average]
    lat = {}
    for name, sim in (("on", on_sim), ("off", off_sim)):
        ts = sim.ts
        lat[name] = sum(ts.finish_t[i] - ts.start_t[i] for i, _, _ in sim.consumed) \
            / len(sim.consumed)
    assert lat["on"] == pytest.approx(lat["off"], rel=0.1)
    moved = [i for i, _, _ in on_sim.consumed if on_sim.ts.repacks[i]]
    assert moved and all(on_sim.ts.versions[i] == 1 for i in moved)
    assert not any(off_sim.ts.repacks[i] for i, _, _ in off_sim.consumed)


def test_a_resident_trajectory_is_admitted_without_prefill():
    """Closed form on one rollout: prefill stalls decode for context / rate, except for a
    trajectory whose KV cache came with it (repack transfer "kv")."""
    from laminar_jax.sim.config import DecodeProfile
    from laminar_jax.sim.models import DecodeModel
    from laminar_jax.sim.rollout import Rollout, TrajStore

    profile = DecodeProfile(tp=1, batch=(1, 2), latency_ms=(10.0, 10.0),
                            kv_capacity_tokens=100_000, prefill_tokens_per_s=1000.0,
                            kv_share=0.0)
    ts = TrajStore()
    ts.add_group([100, 100], [1000, 1000], [None, None])
    ts.gen_done[0] = ts.gen_done[1] = 400          # each moved after 400 generated tokens
    r = Rollout(0, 0, 1, DecodeModel(profile, 8), ts, max_num_seqs=8, reserve=0)
    r.resident.add(1)
    r.waiting.extend([0, 1])
    assert r.admit(5.0) == 500                     # only trajectory 0 is prefilled
    assert r.t_ref == pytest.approx(5.0 + 500 / 1000.0)
    assert r.kv() == 1000 and r.n == 2 and not r.resident
    # both resume where they stopped: 600 steps of 10 ms after the prefill
    assert r.schedule() == pytest.approx(5.5 + 600 * 0.010)
