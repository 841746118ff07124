"""The paper calibration (configs/sim/paper_*_math.yaml) must not drift.

Two tiers:
- fast: per model, every system at the smallest and the largest scale of the paper's Fig 11,
  with fewer warm-up / measured iterations than the paper (the global-batch modes repeat after
  one iteration; the asynchronous ones need a few to fill their pipelines): each cell within
  the configs' tolerance (25%), the paper's ordering and Laminar's speedup over verl at the
  largest scale, and the scaling trend. AReaL at the largest 7B scale needs the paper's full
  warm-up (its batches reach their steady token count only after several updates), so the
  fast tier leaves it to the full one.
- full (`study`: `pytest --studies`, not in CI, ~75 s at load 5): every cell of both tables with the paper's protocol (5 measured updates after
  10 warm-up ones), each within 25% of the paper, steady, and with staleness within its
  mode's bound (`modes.issue_bound`: 4 for AReaL and Laminar in the paper configs): the docs
  table, as a test.
"""
import pathlib

import pytest

from laminar_jax.manager import modes
from laminar_jax.sim.config import load_sim_config
from laminar_jax.sim.engine import Sim

ROOT = pathlib.Path(__file__).resolve().parents[3]
SETUPS = {
    "paper_7b_math": (16, 256),
    "paper_32b_math": (32, 512),
}
SKIP = {("paper_7b_math", "areal", 256)}
# docs/simulator.md: one_step at 16 accelerators (7B) is +25% in the full table (+27% in the
# fast tier's short window); the full tier holds it to 25%
EDGE = {("paper_7b_math", "one_step", 16): 0.30}


def simulate(name):
    path = ROOT / "configs" / "sim" / f"{name}.yaml"
    short = load_sim_config(path, ["run.warmup_steps=1", "run.measure_steps=2"])
    cfg = load_sim_config(path, ["run.warmup_steps=3", "run.measure_steps=2"])
    out = {}
    for cell in cfg.cells:
        if cell.accelerators in SETUPS[name] and (name, cell.system, cell.accelerators) not in SKIP:
            c = short if modes.uses_global_batches(cfg.system(cell.system).mode) else cfg
            out[(cell.system, cell.accelerators)] = (Sim(c, cell).run().summary()["throughput"],
                                                     cell.paper_tokens_per_s)
    return cfg, out


@pytest.fixture(scope="module", params=sorted(SETUPS))
def calibrated(request):
    return request.param, *simulate(request.param)


def test_cells_within_tolerance(calibrated):
    name, cfg, out = calibrated
    bad = {k: round(sim / paper, 3) for k, (sim, paper) in out.items()
           if abs(sim / paper - 1.0) > EDGE.get((name, *k), cfg.tolerance)}
    assert not bad, f"{name}: simulated / paper outside 1 +- {cfg.tolerance}: {bad}"


def test_ordering_and_speedup_at_the_largest_scale(calibrated):
    name, cfg, out = calibrated
    big = SETUPS[name][1]
    sim = {s: v[0] for (s, n), v in out.items() if n == big}
    paper = {s: v[1] for (s, n), v in out.items() if n == big}
    baselines = ("verl", "one_step", "stream")
    assert sim["laminar"] > max(sim[s] for s in sim if s != "laminar")
    assert paper["laminar"] > max(paper[s] for s in paper if s != "laminar")
    if "areal" in sim:
        assert sim["areal"] > max(sim[s] for s in baselines)
    sim_speedup = sim["laminar"] / sim["verl"]
    paper_speedup = paper["laminar"] / paper["verl"]
    assert abs(sim_speedup / paper_speedup - 1.0) <= cfg.tolerance, (sim_speedup, paper_speedup)


def test_scaling_trend(calibrated):
    """Laminar gains the most from the smallest to the largest scale, in the paper and here;
    the global-batch baselines gain far less (they wait for the longest trajectory)."""
    name, cfg, out = calibrated
    small, big = SETUPS[name]
    gains = {}
    for which in (0, 1):
        gains[which] = {s: out[(s, big)][which] / out[(s, small)][which]
                        for s, n in out if n == small and (s, big) in out}
        assert gains[which]["laminar"] == max(gains[which].values())
        assert max(gains[which][s] for s in ("verl", "one_step", "stream")) \
            < 0.5 * gains[which]["laminar"]


@pytest.mark.study   # ~75 s for both tables (load 5): `pytest --studies`; the fast tier above runs in CI
@pytest.mark.parametrize("name", sorted(SETUPS))
def test_every_cell_within_tolerance_with_the_papers_protocol(name):
    cfg = load_sim_config(ROOT / "configs" / "sim" / f"{name}.yaml")
    assert (cfg.run.warmup_steps, cfg.run.measure_steps) == (10, 5)
    ratios, unsteady, stale = {}, [], {}
    for c in cfg.cells:
        s = Sim(cfg, c).run().summary()
        ratios[(c.system, c.accelerators)] = s["throughput"] / c.paper_tokens_per_s
        if not s["steady"]:
            unsteady.append((c.system, c.accelerators))
        system = cfg.system(c.system)
        bound = modes.issue_bound(system.mode, max_staleness=system.max_staleness)
        if bound is not None and s["staleness_max"] > bound:
            stale[(c.system, c.accelerators)] = (s["staleness_max"], bound)
    assert len(ratios) == 25
    bad = {k: round(v, 3) for k, v in ratios.items() if abs(v - 1.0) > cfg.tolerance}
    assert not bad, f"{name}: simulated / paper outside 1 +- {cfg.tolerance}: {bad}"
    # every reported cell is a steady state, with staleness within its mode's bound
    assert not unsteady, f"{name}: unsteady cells {unsteady}"
    assert not stale, f"{name}: staleness above the bound {stale}"
