"""Where a small run's time goes: the per-step breakdown and the start-up phases of `laminar train`.

    PYTHONPATH=$PWD .venv/bin/python experiments/bench_overhead.py [--steps 12] [--init FOLDER]
        [--compare /work/main] [--states cold warm] [--configs small default]

For each config ("default": configs/default.yaml; "small": one rollout, 4 prompts x 4 samples,
32 new tokens) it runs `laminar train` twice as a fresh process: with an empty persistent JAX
compilation cache (cold) and again with the cache the first run filled (warm). Both start from
one SFT checkpoint (the warm-up `laminar train` gives the tiny preset, built once, or --init), so
the warm-up itself is not timed.

Per run it reads the run folder: the means of the `time/*` metrics over the steps after the
first two (laminar_jax/runtime/breakdown.py says what each part is; the overhead is everything
but learner compute and the share of the data wait spent decoding), and the `startup` event
(seconds from the driver's start to each phase's end). The process's launch-to-first-step time
is measured here too (it adds the Python and JAX imports). Writes
experiments/results/bench_overhead.json.

`--compare TREE`: a before/after table in one run. Every run is made twice in a row, first with
the other checkout's code (TREE: its configs, PYTHONPATH=TREE), then with this one's, each code
with its own compile cache; the load average is recorded before and after each run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "default": [],
    "small": ["rollout.num_rollouts=1", "learner.global_batch_groups=4", "data.group_size=4",
              "rollout.max_new_tokens=32", "rollout.max_concurrency=16"],
}
PARTS = ("update_s", "logprob_s", "wait_data_s", "wait_decode_s", "wait_rollout_overhead_s", "batch_s",
         "publish_s", "checkpoint_s", "rpc_gap_s", "unaccounted_s")
SIDE = ("publish_write_s", "relay_convert_s", "relay_chain_s", "rollout_decode_frac", "rollout_pull_frac",
        "rollout_reload_frac", "rollout_rpc_frac", "rollout_reward_frac", "rollout_wait_frac", "rollout_other_frac")


def init_model(work: str) -> str:
    from laminar_jax.runtime.warm_up import model_dir   # `laminar sft`'s layout
    folder = model_dir(os.path.join(work, "init"))
    if not os.path.exists(os.path.join(folder, "config.json")):
        subprocess.run([sys.executable, "-m", "laminar_jax.cli", "sft", "configs/default.yaml",
                        f"run.out_dir={work}", "run.name=init"], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=REPO), check=True)
    return folder


def run_once(name: str, extra: list[str], *, init: str, steps: int, cache: str, work: str,
             repo: str = REPO) -> dict:
    run_dir = os.path.join(work, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.time()
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-m", "laminar_jax.cli", "train", "configs/default.yaml",
                           f"model.hf_path={init}", f"run.steps={steps}", f"run.out_dir={work}", f"run.name={name}",
                           f"run.compile_cache={cache}", "run.log_every=100", *extra],
                          cwd=repo, env=dict(os.environ, PYTHONPATH=repo), capture_output=True, text=True,
                          timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{name}: laminar train failed:\n{proc.stderr[-3000:]}")
    from laminar_jax.analysis import load_run
    m = load_run(run_dir).metrics.sort_values("step")   # the metrics/ part files
    from laminar_jax.runtime.breakdown import overhead, summarise
    # means over the steps after the first two (compiles): the parts add up to the mean step
    med = summarise([dict(r, **overhead(r)) for r in m.to_dict("records")])
    med = {k: v for k, v in med.items() if np.isfinite(v)}
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    startup = next(e for e in events if e.get("kind") == "startup")
    startup = {k: v for k, v in startup.items() if k.endswith("_s")}
    return {"breakdown": med, "startup": startup, "launch_to_first_step_s": float(m["time/unix_s"].iloc[0] - t0),
            "wall_s": time.time() - t0, "steps": int(len(m)), "load_before": load, "load_after": os.getloadavg()[0],
            "prints": [line for line in proc.stdout.splitlines() if line.startswith("start-up")]}


def print_breakdown(name: str, r: dict) -> None:
    b = r["breakdown"]
    wall = b["step_wall_s"]
    print(f"\n{name}: mean step {wall:.3f} s, overhead {b['overhead_frac']:.0%} "
          f"(load {r['load_before']:.1f} -> {r['load_after']:.1f})")
    print(f"  {'part':<26}{'s':>8}{'% of step':>11}")
    for k in PARTS:
        if k in b:
            indent = "    " if k.startswith("wait_") and k != "wait_data_s" else "  "
            print(f"{indent}{k[:-2]:<{28 - len(indent)}}{b[k]:>8.3f}{b[k] / wall:>11.0%}")
    print("  off the learner's path: " + ", ".join(f"{k} {b[k]:.3f}" for k in SIDE if k in b))


def print_compare(results: dict) -> None:
    """Before/after per config and cache state: each part's mean seconds per step."""
    for key in [k[len("after:"):] for k in results if k.startswith("after:")]:
        b, a = results.get(f"before:{key}"), results[f"after:{key}"]
        if b is None:
            continue
        print(f"\n{key}: before -> after (load {b['load_before']:.1f}/{a['load_before']:.1f} at the start)")
        print(f"  {'s per step':<26}{'before':>9}{'after':>9}{'after/before':>14}")
        for k in ("step_wall_s", "overhead_s") + PARTS:
            x, y = b["breakdown"].get(k), a["breakdown"].get(k)
            if x is not None and y is not None:
                print(f"  {k[:-2]:<26}{x:>9.3f}{y:>9.3f}{(y / x if x > 1e-9 else float('nan')):>14.2f}")
        x, y = b["launch_to_first_step_s"], a["launch_to_first_step_s"]
        print(f"  {'launch->first step':<26}{x:>9.1f}{y:>9.1f}{y / x:>14.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--init", default=None, help="HF model folder (default: laminar sft once)")
    p.add_argument("--work", default="/tmp/laminar-bench-overhead")
    p.add_argument("--out", default=os.path.join(REPO, "experiments", "results", "bench_overhead.json"))
    p.add_argument("--compare", default=None, metavar="TREE",
                   help="another checkout (e.g. /work/main): each run is made with its code first (before)")
    p.add_argument("--states", nargs="+", default=["cold", "warm"], choices=["cold", "warm"],
                   help="warm alone still fills the cache with a cold run first (not reported)")
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    init = a.init or init_model(a.work)
    trees = [("before", os.path.abspath(a.compare)), ("after", REPO)] if a.compare else [("", REPO)]
    results = {}
    for name in a.configs:
        for label, _ in trees:
            shutil.rmtree(os.path.join(a.work, f"cache-{label}{name}"), ignore_errors=True)
        for state in ("cold", "warm"):
            for label, repo in trees:   # interleaved: before and after back to back
                key = f"{label + ':' if label else ''}{name}-{state}"
                print(f"bench: {key} ...", flush=True)
                r = run_once(key.replace(":", "-"), CONFIGS[name], init=init, steps=a.steps, repo=repo,
                             cache=os.path.join(a.work, f"cache-{label}{name}"), work=a.work)
                if state in a.states:
                    results[key] = r
                    print_breakdown(key, r)
    if a.compare:
        print_compare(results)
    print("\nstart-up (s from the driver's start to the end of each phase; launch adds the imports)")
    phases = ["ray_s", "actors_s", "rollouts_s", "learner_s", "relays_s", "publish_s", "first_step_s"]
    print(f"  {'run':<16}" + "".join(f"{k[:-2]:>11}" for k in phases) + f"{'launch->1st':>13}")
    for key, r in results.items():
        print(f"  {key:<16}" + "".join(f"{r['startup'].get(k, float('nan')):>11.1f}" for k in phases)
              + f"{r['launch_to_first_step_s']:>13.1f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"steps": a.steps, "init": init, "cores": os.cpu_count(), "compare": a.compare,
                   "runs": results}, f, indent=1)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
