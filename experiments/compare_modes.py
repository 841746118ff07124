"""The same long-tail workload in every scheduling mode, on the real runtime (Ray, JAX engines,
learner, relays, manager), reporting what the paper's section 8 compares:

    learner-consumed trajectories/s and tokens/s, learner idle %, rollout idle %, staleness
    distribution, KV-cache use, repack moves

Workload: the countdown task (response lengths drawn from a power law, p99 about 10x the median)
on a short supervised warm-up of the tiny model, several rollouts. Two engine settings:
    real       the JAX engine as it runs on this CPU;
    emulated   `runtime.engines.LatencyEngine`: every decode step lasts at least what the
               simulator's decode model (`sim.models.DecodeModel`, the paper's 7B TP1 profile,
               scaled by --latency-scale) gives for its batch and KV tokens, so rollouts are
               accelerator-bound the way the paper's are, while every token is still real.
Modes: sync, one_step, stream, partial, laminar (repack on) and laminar without repack.

    python experiments/compare_modes.py                       # both engines, all modes
    python experiments/compare_modes.py --engines emulated --steps 8
    # rollout-bound, versions shared by several rollouts (the paper's regime; repack can pair them):
    python experiments/compare_modes.py --engines emulated --modes laminar,laminar_no_repack,sync \
        --steps 8 --groups 16 --latency-scale 12   # results/compare_modes_rollout_bound.*

Throughput counts the steady part of a run: steps after the first (start-up and compiles
excluded). "x sync" is tokens/s, the paper's throughput (prompt + response tokens consumed per
second); trajectories/s follows it. Repack merges only rollouts on the same weight version, so
it needs a global batch larger than one rollout's (as in the paper: 8192 trajectories against a
few hundred per rollout); with `--groups` near one rollout's batch every rollout sits on its own
version and repack has nothing to merge. Writes experiments/results/compare_modes.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from laminar_jax.analysis import load_run  # noqa: E402
from laminar_jax.config import load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {
    "sync": {"manager.mode": "sync"},
    "one_step": {"manager.mode": "one_step"},
    "stream": {"manager.mode": "stream", "learner.mini_batches": 2, "manager.max_staleness": 1},
    "partial": {"manager.mode": "partial", "manager.max_staleness": 4},
    "laminar": {"manager.mode": "laminar", "manager.repack": True},
    "laminar_no_repack": {"manager.mode": "laminar", "manager.repack": False},
}


def latency_model(scale: float):
    """The simulator's decode model for the paper's 7B model at TP1 (configs/sim/paper_7b_math.yaml)."""
    from laminar_jax.sim.config import DecodeProfile
    from laminar_jax.sim.models import DecodeModel
    profile = DecodeProfile(tp=1, batch=(1, 4, 8, 16, 32, 64, 128, 256),
                            latency_ms=(7.0, 7.3, 7.7, 8.4, 9.6, 12.6, 18.1, 29.6),
                            kv_capacity_tokens=8192, prefill_tokens_per_s=2e4, context_ref=256)
    return DecodeModel(profile, 256, overhead=scale)


def config(out_dir: str, name: str, model_dir: str, args, extra: dict):
    overrides = {"run.out_dir": out_dir, "run.name": name, "data.task": "countdown",
                 "run.steps": args.steps, "rollout.num_rollouts": args.rollouts, "rollout.max_concurrency": 32,
                 "learner.global_batch_groups": args.groups, "data.group_size": 8, "manager.repack_interval_s": 0.25,
                 "relay.store_dir": "/dev/shm/laminar-compare", "run.log_every": 1000,
                 "data.buffer_groups": 2 * args.groups, **extra}
    if model_dir is not None:
        overrides["model.hf_path"] = model_dir
    return load_config(os.path.join(ROOT, "configs/default.yaml"), [f"{k}={v}" for k, v in overrides.items()])


def measure(run_dir: str, summary: dict) -> dict:
    run = load_run(run_dir)
    m = run.metrics.iloc[1:] if len(run.metrics) > 1 else run.metrics
    wall = float(m.step_wall_s.sum())
    traj = run.trajectories
    stale = traj.staleness.value_counts(normalize=True).sort_index()
    return {"steps": int(len(run.metrics)), "steady_wall_s": wall,
            "trajectories_per_s": float(m.consumed_trajectories.sum() / wall),
            "tokens_per_s": float(m.consumed_tokens.sum() / wall),
            "learner_idle_pct": 100 * float(m.learner_idle_frac.mean()),
            "rollout_idle_pct": 100 * float(m.rollout_idle_frac.mean()),
            "kv_use_pct": 100 * float(m.kv_use_mean.mean()),
            "staleness": {int(k): float(v) for k, v in stale.items()},
            "staleness_mean": float(traj.staleness.mean()), "mixed_version_frac": float(traj.mixed_versions.mean()),
            "repack_moves": int(summary["manager"].get("moves", 0)),
            "reward_first": summary["reward_first"], "reward_last": summary["reward_last"],
            "response_len_p50": float(np.percentile(traj.response_len, 50)) if "response_len" in traj else None,
            "response_len_p99": float(np.percentile(traj.response_len, 99)) if "response_len" in traj else None}


def table(results: dict) -> str:
    lines = []
    for engine, rows in results.items():
        base = rows.get("sync", {})
        lines.append(f"\n{engine} engine (x sync: tokens/s, the paper's throughput, then trajectories/s)")
        lines.append(f"{'mode':<18}{'traj/s':>8}{'tok/s':>8}{'x sync':>8}{'(traj)':>8}{'learner idle':>14}"
                     f"{'rollout idle':>14}{'kv':>6}{'stale mean':>12}{'moves':>7}  staleness distribution")
        for mode, r in rows.items():
            dist = " ".join(f"{k}:{v:.2f}" for k, v in r["staleness"].items())
            ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
            ratio_traj = r["trajectories_per_s"] / base["trajectories_per_s"] if base else float("nan")
            lines.append(f"{mode:<18}{r['trajectories_per_s']:>8.1f}{r['tokens_per_s']:>8.0f}{ratio:>8.2f}{ratio_traj:>8.2f}"
                         f"{r['learner_idle_pct']:>13.0f}%{r['rollout_idle_pct']:>13.0f}%{r['kv_use_pct']:>5.0f}%"
                         f"{r['staleness_mean']:>12.2f}{r['repack_moves']:>7}  {dist}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="emulated,real")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--groups", type=int, default=4, help="prompt groups per learner step")
    p.add_argument("--latency-scale", type=float, default=4.0)
    p.add_argument("--learner-step-s", type=float, default=0.0,
                   help="emulated engine: each learner update lasts at least this long (0: as fast as the CPU)")
    p.add_argument("--out", default=os.path.join(ROOT, "experiments/results"))
    p.add_argument("--work", default="/tmp/laminar-compare-modes")
    args = p.parse_args(argv)

    import ray

    from laminar_jax.runtime import cluster, driver
    warm_cfg = config(args.work, "warm", None, args, {"sft.steps": 60})
    model_dir = driver.warm_up(warm_cfg, os.path.join(args.work, "warm"))
    cluster.start(warm_cfg)
    results: dict = {}
    path = os.path.join(args.out, "compare_modes.json")
    try:
        for engine in args.engines.split(","):
            lat = latency_model(args.latency_scale) if engine == "emulated" else None
            results[engine] = {}
            for mode in args.modes.split(","):
                name = f"{engine}-{mode}-{int(time.time())}"
                cfg = config(args.work, name, model_dir, args, MODES[mode])
                t0 = time.time()
                summary = driver.run(cfg, latency_model=lat, quiet=True,
                                     min_update_s=args.learner_step_s if engine == "emulated" else 0.0)
                results[engine][mode] = measure(summary["run_dir"], summary)
                r = results[engine][mode]
                print(f"{engine:<9}{mode:<18} {r['trajectories_per_s']:6.1f} traj/s {r['tokens_per_s']:7.0f} tok/s "
                      f"learner idle {r['learner_idle_pct']:3.0f}% rollout idle {r['rollout_idle_pct']:3.0f}% "
                      f"moves {r['repack_moves']} ({time.time() - t0:.0f} s)", flush=True)
                os.makedirs(args.out, exist_ok=True)
                with open(path, "w") as f:
                    json.dump({"args": vars(args), "results": results}, f, indent=1)
    finally:
        ray.shutdown()
    print(table(results))
    for engine, rows in results.items():
        lam = rows.get("laminar")
        for other, label in (("sync", "sync"), ("laminar_no_repack", "laminar without repack")):
            if lam and other in rows:
                o = rows[other]
                print(f"{engine}: laminar / {label} = {lam['tokens_per_s'] / o['tokens_per_s']:.2f} (tokens/s), "
                      f"{lam['trajectories_per_s'] / o['trajectories_per_s']:.2f} (trajectories/s)")
    with open(os.path.join(args.out, "compare_modes.txt"), "w") as f:
        f.write(table(results) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
