"""Simulator scale benchmark: every scheduling mode at 1024 accelerators, >= 100k trajectories.

    .venv/bin/python experiments/bench_sim.py [--config configs/sim/paper_7b_math.yaml]

Each mode runs until its learner has consumed at least --trajectories trajectories (global
batch 8192), on 1024 accelerators with the paper's 1024-accelerator placements (Table 2, 72B
column): sync colocated on all of them, one_step / stream 256 learner / 768 rollout
accelerators (384 rollouts of TP2), partial 512 / 512 (512 rollouts of TP1), laminar 768 / 256
(256 rollouts of TP1). Prints CPU and wall-clock seconds per mode; the budget is one minute.
"""

from __future__ import annotations

import argparse
import math
import time

from laminar_jax.sim.config import load_sim_config
from laminar_jax.sim.engine import Sim

PLACEMENTS = {
    # system name in the config -> (train, rollout); colocated systems use all accelerators
    "verl": (1024, 1024),
    "one_step": (256, 768),
    "stream": (256, 768),
    "areal": (512, 512),
    "laminar": (768, 256),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/sim/paper_7b_math.yaml")
    p.add_argument("--trajectories", type=int, default=100_000)
    p.add_argument("--accelerators", type=int, default=1024)
    args = p.parse_args()
    base = load_sim_config(args.config)
    steps = math.ceil(args.trajectories / base.run.global_batch)
    n = args.accelerators
    print(f"{args.config}: {n} accelerators, {steps} learner updates "
          f"(>= {args.trajectories:,} consumed trajectories)")
    for system in base.systems:
        train, rollout = PLACEMENTS[system.name]
        if system.colocated:
            train = rollout = n
        else:
            train, rollout = n * train // 1024, n * rollout // 1024
        cell = (f"cells=[{{system: {system.name}, accelerators: {n}, train: {train}, "
                f"rollout: {rollout}}}]")
        cfg = load_sim_config(args.config, [cell, "run.warmup_steps=0",
                                            f"run.measure_steps={steps}"])
        t0, c0 = time.perf_counter(), time.process_time()
        sim = Sim(cfg, cfg.cells[0]).run()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        consumed = len(sim.consumed)
        s = sim.summary()
        print(f"  {system.name:>9} ({system.mode:>8}): {len(sim.rollouts):4d} rollouts, "
              f"{consumed:7,d} consumed / {len(sim.ts):7,d} generated trajectories, "
              f"{sim.now:8,.0f} s simulated, {s['throughput']:10,.0f} tok/s, "
              f"cpu {cpu:5.1f} s, wall {wall:5.1f} s", flush=True)


if __name__ == "__main__":
    main()
