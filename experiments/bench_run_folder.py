"""Run-folder writer at scale: append-only part files against the old whole-file rewrite.

    .venv/bin/python experiments/bench_run_folder.py [--steps 200] [--rows-per-step 2000]

Each arm writes the same trajectory rows (the learner's `log_row` columns) for `--steps` learner
steps, flushing every 10 steps, in a fresh subprocess. "parts" is `metrics.RunWriter` (a new
Parquet part per flush, only the rows since the last flush in memory); "rewrite" is the previous
writer's scheme, re-implemented here as the baseline (every row kept in memory, the whole file
rewritten at each flush). Prints peak RSS growth and the seconds spent in the last flush, and
writes experiments/results/bench_run_folder.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time, psutil
import pandas as pd
arm, out, steps, per = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from laminar_jax.metrics import RunWriter
proc = psutil.Process()
base = proc.memory_info().rss
def rows(step):
    return [{"group_id": f"e0-{step}-{i // 8}", "prompt_id": f"p{i}", "sample_index": i % 8,
             "rollout_id": "rollout-0", "prompt_len": 10, "response_len": 20, "reward": 0.5,
             "finish_reason": "stop", "gen_version": step, "oldest_version": step, "mixed_versions": False,
             "repack_count": 0, "staleness": 1, "learner_version": step, "t_queue": 0.1, "t_gen": 0.2,
             "trajectory_id": f"e0-{step}-{i // 8}/{i % 8}"} for i in range(per)]
peak, last_flush = 0, 0.0
if arm == "parts":
    w = RunWriter(out, tensorboard=False, flush_every=10, flush_every_s=1e9)
    for step in range(steps):
        w.log_step(step, {"loss": 1.0})
        w.log_trajectories(rows(step), step=step)
        if step % 10 == 9:
            t0 = time.perf_counter(); w.flush(); last_flush = time.perf_counter() - t0
        peak = max(peak, proc.memory_info().rss - base)
    w.close()
else:  # the previous writer: all rows in memory, the whole file rewritten at each flush
    kept = []
    for step in range(steps):
        kept.extend(dict(r, step=step) for r in rows(step))
        if step % 10 == 9:
            t0 = time.perf_counter()
            pd.DataFrame.from_records(kept).to_parquet(os.path.join(out, ".t.tmp"), index=False)
            os.replace(os.path.join(out, ".t.tmp"), os.path.join(out, "trajectories.parquet"))
            last_flush = time.perf_counter() - t0
        peak = max(peak, proc.memory_info().rss - base)
print(json.dumps({"peak_rss_growth_mb": peak / 2**20, "last_flush_s": last_flush}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rows-per-step", type=int, default=2000)
    p.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    args = p.parse_args()
    results = {}
    for arm in ("parts", "rewrite"):
        with tempfile.TemporaryDirectory() as out:
            proc = subprocess.run([sys.executable, "-c", CHILD, arm, out, str(args.steps), str(args.rows_per_step)],
                                  capture_output=True, text=True, check=True, cwd=ROOT,
                                  env=dict(os.environ, PYTHONPATH=str(ROOT)))
            results[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = args.steps * args.rows_per_step
    print(f"{rows:,} trajectory rows over {args.steps} steps, flush every 10 steps")
    print(f"{'writer':<10} {'peak RSS growth (MB)':>22} {'last flush (s)':>16}")
    for arm, r in results.items():
        print(f"{arm:<10} {r['peak_rss_growth_mb']:>22.1f} {r['last_flush_s']:>16.3f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_run_folder.json")
    with open(path, "w") as f:
        json.dump({"rows": rows, "steps": args.steps, "rows_per_step": args.rows_per_step, "arms": results}, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
