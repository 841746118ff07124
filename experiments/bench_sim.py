"""Simulator speed: CPU seconds per cell against scale, and the paper tables with their folders.

    .venv/bin/python experiments/bench_sim.py                       # both parts, 7B workload
    .venv/bin/python experiments/bench_sim.py --scales 256,1024,4096 --skip-tables
    .venv/bin/python experiments/bench_sim.py --scales "" --tables configs/sim/paper_7b_math.yaml \
        --out experiments/results/bench_sim_tables.json

Part 1 (scale): every system of --config at each scale of --scales, with the paper's
1024-accelerator placements scaled (Table 2, 72B column: sync colocated on all accelerators,
one_step / stream 1/4 learner, partial 1/2, laminar 3/4), run for --updates learner updates
(no warm-up) with the config's buffer and caps. A cell that stops at a cap (`CapReached`)
is reported as such with its CPU time. Part 2 (tables): `laminar simulate`'s path
(`sim.cli.simulate`) on each paper config, writing run folders with run.write=full and
run.write=summary into a temporary folder, CPU and wall seconds per table.

CPU seconds (`time.process_time`) are printed next to wall seconds: on a shared machine the
wall clock counts other processes' time. Writes experiments/results/bench_sim.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import tempfile
import time

from laminar_jax.sim.cli import simulate
from laminar_jax.sim.config import load_sim_config
from laminar_jax.sim.engine import CapReached, Sim

PLACEMENTS = {
    # system name in the config -> (train, rollout) share of 1024; colocated: all of them
    "verl": (1024, 1024),
    "one_step": (256, 768),
    "stream": (256, 768),
    "areal": (512, 512),
    "laminar": (768, 256),
}
RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "bench_sim.json"


def scale_part(config: str, scales: list[int], updates: int) -> list[dict]:
    base = load_sim_config(config)
    rows = []
    print(f"{config}: CPU seconds per cell, {updates} learner updates of {base.run.global_batch}")
    print(f"  {'system':>9} {'acc.':>5} {'rollouts':>8} {'issued':>9} {'consumed':>9} "
          f"{'sim s':>7} {'steady':>6} {'cpu s':>6} {'wall s':>6}")
    for n in scales:
        for system in base.systems:
            train, rollout = PLACEMENTS[system.name]
            if system.colocated:
                train = rollout = n
            else:
                train, rollout = n * train // 1024, n * rollout // 1024
            rollout -= rollout % system.rollout_tp
            cell = (f"cells=[{{system: {system.name}, accelerators: {train + rollout if not system.colocated else n}, "
                    f"train: {train}, rollout: {rollout}}}]")
            cfg = load_sim_config(config, [cell, "run.warmup_steps=0",
                                           f"run.measure_steps={updates}"])
            t0, c0 = time.perf_counter(), time.process_time()
            row = {"system": system.name, "mode": system.mode, "accelerators": n,
                   "train": train, "rollout": rollout}
            try:
                sim = Sim(cfg, cfg.cells[0]).run()
                s = sim.summary()
                row.update(issued=sim.issued, consumed=len(sim.consumed_ids),
                           sim_time_s=sim.now, steady=s["steady"], throughput=s["throughput"],
                           rollouts=len(sim.rollouts), cap=None)
            except CapReached as e:
                row.update(cap=str(e), rollouts=rollout // system.rollout_tp)
            row.update(cpu_s=time.process_time() - c0, wall_s=time.perf_counter() - t0)
            rows.append(row)
            if row["cap"]:
                print(f"  {system.name:>9} {n:5d} {row['rollouts']:8d}  stopped at a cap: "
                      f"{row['cap'].split('stopped at ')[1].split(' after')[0]}"
                      f"{'':>4} {row['cpu_s']:6.1f} {row['wall_s']:6.1f}", flush=True)
            else:
                print(f"  {system.name:>9} {n:5d} {row['rollouts']:8d} {row['issued']:9,d} "
                      f"{row['consumed']:9,d} {row['sim_time_s']:7,.0f} {str(row['steady']):>6} "
                      f"{row['cpu_s']:6.1f} {row['wall_s']:6.1f}", flush=True)
    return rows


def table_part(configs: list[str], writes: tuple[str, ...] = ("full", "summary")) -> list[dict]:
    rows = []
    print("paper tables through `laminar simulate`'s path (sim.cli.simulate), writing folders")
    for config in configs:
        for write in writes:
            with tempfile.TemporaryDirectory() as tmp:
                cfg = load_sim_config(config, [f"run.out_dir={tmp}", f"run.write={write}"])
                t0, c0 = time.perf_counter(), time.process_time()
                results = simulate(cfg)
                cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            unsteady = [f"{r.system}@{r.accelerators}" for r in results if not r.steady]
            rows.append({"config": config, "write": write, "cells": len(results),
                         "cpu_s": cpu, "wall_s": wall, "unsteady": unsteady})
            print(f"  {config}: {len(results)} cells, run.write={write}: cpu {cpu:5.1f} s, "
                  f"wall {wall:5.1f} s; unsteady: {', '.join(unsteady) or 'none'}", flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/sim/paper_7b_math.yaml")
    p.add_argument("--scales", default="64,256,1024,4096")
    p.add_argument("--updates", type=int, default=13)
    p.add_argument("--tables", default="configs/sim/paper_7b_math.yaml,configs/sim/paper_32b_math.yaml")
    p.add_argument("--skip-tables", action="store_true")
    p.add_argument("--writes", default="full,summary", help="run.write levels of the table part")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    out = {"machine": platform.processor() or platform.machine(), "argv": vars(args)}
    if args.scales:          # --scales "" skips the scale part
        out["scale"] = scale_part(args.config, [int(x) for x in args.scales.split(",")],
                                  args.updates)
    if not args.skip_tables:
        out["tables"] = table_part(args.tables.split(","), tuple(args.writes.split(",")))
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1, default=float) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
