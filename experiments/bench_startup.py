"""Start-up of `laminar train`, before and after: the same runs from two checkouts, interleaved.

    PYTHONPATH=$PWD .venv/bin/python experiments/bench_startup.py --before /work/main [--reps 2]
    # one checkout, two configs: a Ray run against a colocated one
    ... --before $PWD --set rollout.num_rollouts=1 --after-set run.colocate=true

Each run is a fresh `laminar train configs/default.yaml run.steps=2` process (the tiny model, 2
rollouts, relays on), from the checkout under test (PYTHONPATH and cwd point at it). Cases:
  hf-warm:  model.hf_path = one SFT checkpoint, the compilation cache already filled by the same
            config (the cache is primed once per checkout before the timed runs);
  hf-cold:  the same with an empty compilation cache;
  warm-up:  the default config (the supervised warm-up first, then RL), warm cache.
Per run: launch to the first RL step's end (the metrics' `time/unix_s` of step 0), the total wall
time, the CPU seconds of the driver and the processes it reaps (Ray's actor processes are
children of the raylet, which is killed rather than waited for: an undercount; the learner's
own CPU seconds are in `learner_init`),
the learner's `learner_init` phases (wall and CPU) and step 0's `time/*` breakdown, the `startup`
event's phases, and the load average before and after (the machine is shared: read ratios inside
one run of this script, not absolute seconds). Writes
experiments/results/bench_startup.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# issue 20's start-up budget, launch to the end of the first RL step (tiny model, this machine kind)
BUDGET_S = {"hf-warm": 10.0, "hf-cold": 25.0}


def run_once(code: str, name: str, extra: list[str], *, cache: str, work: str) -> dict:
    run_dir = os.path.join(work, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    load = os.getloadavg()[0]
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "laminar_jax.cli", "train", "configs/default.yaml", "run.steps=2",
                           f"run.out_dir={work}", f"run.name={name}", f"run.compile_cache={cache}", *extra],
                          cwd=code, env=dict(os.environ, PYTHONPATH=code), capture_output=True, text=True,
                          timeout=1200)
    wall = time.time() - t0
    # CPU s of the driver and what it reaps (not the actors: see the docstring)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (usage.ru_utime - usage0.ru_utime) + (usage.ru_stime - usage0.ru_stime)
    if proc.returncode:
        raise RuntimeError(f"{name}: laminar train failed:\n{proc.stderr[-3000:]}")
    from laminar_jax.analysis import load_run
    m = load_run(run_dir).metrics.sort_values("step")   # the metrics/ part files
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    startup = next(e for e in events if e.get("kind") == "startup")
    init = next((e for e in events if e.get("kind") == "learner_init"), {})
    return {"launch_to_first_step_s": float(m["time/unix_s"].iloc[0] - t0), "wall_s": wall, "cpu_s": cpu,
            "startup": {k: v for k, v in startup.items() if k.endswith("_s")},
            "learner_init": {k: v for k, v in init.items() if k.endswith("_s")},
            "step0": {k: float(m[k].iloc[0]) for k in m.columns
                      if k.startswith("time/") and k.endswith("_s") and k != "time/unix_s"}
                     | {k: float(m[k].iloc[0]) for k in ("learner/step_compiles", "learner/logprob_compiles")
                        if k in m.columns},
            "load_before": load, "load_after": os.getloadavg()[0],
            "prints": [line for line in proc.stdout.splitlines() if line.startswith("start-up")]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="checkout of the baseline (e.g. /work/main)")
    p.add_argument("--after", default=REPO)
    p.add_argument("--reps", type=int, default=2, help="interleaved hf-warm runs per checkout")
    p.add_argument("--cold-reps", type=int, default=1, help="interleaved hf-cold runs per checkout")
    p.add_argument("--cases", nargs="+", default=["hf-warm", "hf-cold", "warm-up"])
    p.add_argument("--init", default=None, help="SFT checkpoint for the hf cases (default: laminar sft once)")
    p.add_argument("--work", default="/tmp/laminar-bench-startup")
    p.add_argument("--keep-caches", action="store_true", help="reuse primed caches of an earlier call")
    p.add_argument("--out", default=os.path.join(REPO, "experiments", "results", "bench_startup.json"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override of every run (repeatable), e.g. rollout.num_rollouts=1")
    p.add_argument("--before-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override of the before side's runs only (repeatable)")
    p.add_argument("--after-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override of the after side's runs only (repeatable), e.g. run.colocate=true")
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    init = a.init
    if init is None:
        from laminar_jax.runtime.warm_up import model_dir   # `laminar sft`'s layout
        init = model_dir(os.path.join(a.work, "init"))
        if not os.path.exists(os.path.join(init, "config.json")):
            subprocess.run([sys.executable, "-m", "laminar_jax.cli", "sft", "configs/default.yaml",
                            f"run.out_dir={a.work}", "run.name=init"], cwd=a.after,
                           env=dict(os.environ, PYTHONPATH=a.after), check=True, capture_output=True)
    sides = {"before": a.before, "after": a.after}
    own = {"before": a.before_set, "after": a.after_set}
    hf = {side: [f"model.hf_path={init}", *a.set, *own[side]] for side in sides}
    runs: list[dict] = []

    def timed(side: str, case: str, rep: int, extra: list[str], cache: str) -> None:
        name = f"{side}-{case}-{rep}"
        print(f"bench: {name} (load {os.getloadavg()[0]:.1f})", flush=True)
        r = run_once(sides[side], name, extra, cache=cache, work=a.work)
        r.update(side=side, case=case, rep=rep)
        print(f"bench:   first step {r['launch_to_first_step_s']:.1f} s, wall {r['wall_s']:.1f} s, "
              f"cpu {r['cpu_s']:.1f} s", flush=True)
        runs.append(r)
        with open(a.out + ".partial", "w") as f:   # what a later failure (or a stop) would otherwise lose
            json.dump(runs, f, indent=1)

    caches = {side: os.path.join(a.work, f"cache-{side}") for side in sides}
    if "hf-warm" in a.cases or "warm-up" in a.cases:
        for side in sides:   # prime each side's cache with the timed configs (not timed)
            if not a.keep_caches:
                shutil.rmtree(caches[side], ignore_errors=True)
            elif os.path.isdir(caches[side]):
                continue
            print(f"bench: priming the {side} cache", flush=True)
            run_once(sides[side], f"{side}-prime", hf[side], cache=caches[side], work=a.work)
            if "warm-up" in a.cases:
                run_once(sides[side], f"{side}-prime-wu", [*a.set, *own[side]], cache=caches[side], work=a.work)
    order = list(sides)
    for rep in range(a.reps if "hf-warm" in a.cases else 0):
        for side in (order if rep % 2 == 0 else order[::-1]):
            timed(side, "hf-warm", rep, hf[side], caches[side])
    for rep in range(a.cold_reps if "hf-cold" in a.cases else 0):
        for side in (order[::-1] if rep % 2 == 0 else order):
            cold = os.path.join(a.work, f"cache-cold-{side}")
            shutil.rmtree(cold, ignore_errors=True)
            timed(side, "hf-cold", rep, hf[side], cold)
    if "warm-up" in a.cases:
        for side in order:
            timed(side, "warm-up", 0, [*a.set, *own[side]], caches[side])
    summary = {}
    for case in a.cases:
        for side in sides:
            rs = [r for r in runs if r["case"] == case and r["side"] == side]
            if rs:
                summary[f"{case}/{side}"] = {
                    "launch_to_first_step_s": float(np.mean([r["launch_to_first_step_s"] for r in rs])),
                    "wall_s": float(np.mean([r["wall_s"] for r in rs])),
                    "cpu_s": float(np.mean([r["cpu_s"] for r in rs])),
                    "load_mean": float(np.mean([(r["load_before"] + r["load_after"]) / 2 for r in rs])),
                    "phases_s": {k: float(np.mean([r["startup"].get(k, np.nan) for r in rs]))
                                 for k in rs[0]["startup"]}, "runs": len(rs)}
                if case in BUDGET_S:   # every run of the case within the budget
                    summary[f"{case}/{side}"].update(budget_s=BUDGET_S[case], within_budget=bool(
                        max(r["launch_to_first_step_s"] for r in rs) <= BUDGET_S[case]))
    print(f"\n{'case/side':<18}{'1st step s':>11}{'budget':>14}{'wall s':>9}{'cpu s':>8}{'load':>7}"
          f"  phases (s from the driver's start)")
    for key, s in summary.items():
        phases = ", ".join(f"{k[:-2]} {v:.1f}" for k, v in s["phases_s"].items())
        budget = f"{s['budget_s']:.0f} s {'met' if s['within_budget'] else 'MISSED'}" if "budget_s" in s else "-"
        print(f"{key:<18}{s['launch_to_first_step_s']:>11.1f}{budget:>14}{s['wall_s']:>9.1f}{s['cpu_s']:>8.1f}"
              f"{s['load_mean']:>7.1f}  {phases}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"before": a.before, "after": a.after, "init": init, "cores": os.cpu_count(), "set": a.set,
                   "before_set": a.before_set, "after_set": a.after_set, "summary": summary, "runs": runs}, f, indent=1)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
