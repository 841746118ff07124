"""The same long-tail workload in every scheduling mode, on the real runtime (Ray, JAX engines,
learner, relays, manager), reporting what the paper's section 8 compares:

    learner-consumed trajectories/s and tokens/s, learner idle %, rollout idle %, staleness
    distribution, KV-cache use, repack moves

(the printed table gives the mean staleness; the .json keeps every run's staleness
distribution, KV-cache use and run folder.)

Workload: the countdown task (response lengths drawn from a power law, p99 about 10x the median)
on a short supervised warm-up of the tiny model, several rollouts. Two engine settings:
    real       the JAX engine as it runs on this CPU;
    emulated   `runtime.engines.LatencyEngine`: every decode step lasts at least what the
               simulator's decode model (`sim.models.DecodeModel`, the paper's 7B TP1 profile,
               scaled by --latency-scale) gives for its batch and KV tokens, so rollouts are
               accelerator-bound the way the paper's are, while every token is still real.
Modes: sync, one_step, stream, partial, laminar (repack on) and laminar without repack.

Every command below wrote the results named after it, under experiments/results/ (the runs also
passed --work, a scratch folder under /tmp, which the .txt's first line records):

    # both engines, all modes, defaults (10 steps, 4 groups, --latency-scale 4):
    python experiments/compare_modes.py                          # compare_modes.*
    # rollout-bound, versions shared by several rollouts (the paper's regime; repack can pair
    # them), against sync; at --latency-scale 24 the CPU learner keeps up (learner idle > 50%,
    # rollouts never idle), 3 interleaved repeats after an unmeasured priming run:
    python experiments/compare_modes.py --engines emulated --modes sync,laminar,laminar_no_repack \
        --steps 8 --groups 16 --latency-scale 24 --repeats 3 --prime-steps 8 \
        --name compare_modes_rollout_bound                # compare_modes_rollout_bound.*
    # repack's gain alone in the same regime, 5 interleaved pairs:
    python experiments/compare_modes.py --engines emulated --modes laminar,laminar_no_repack \
        --steps 8 --groups 16 --latency-scale 24 --repeats 5 --prime-steps 8 \
        --name compare_modes_repack                       # compare_modes_repack.*

--repeats N runs every mode N times, interleaved and counterbalanced (A B, B A, A B, ...), and
reports per mode the mean +- std over the repeats, and repack's gain (laminar over
laminar_no_repack, paired by repeat) as a mean with a 95% Student-t interval. Each run also
reports, from its run folder, the share of rollout time spent advancing only 1-4 trajectories
(the long-tail phase repack targets), the mean batch a busy rollout advances, the overhead of a
move (release to adopt) and how long a released rollout waits before its next batch. A
persistent XLA cache (under --work) is shared by all runs, so a learner compile of a new length
bucket does not land in one run's measured steps; --prime-steps fills it first.

Throughput counts the steady part of a run: steps after the first (start-up and compiles
excluded). "x sync" is tokens/s, the paper's throughput (prompt + response tokens consumed per
second); trajectories/s follows it. Repack merges only rollouts on the same weight version, so
it needs a global batch larger than one rollout's (as in the paper: 8192 trajectories against a
few hundred per rollout); with `--groups` near one rollout's batch every rollout sits on its own
version and repack has nothing to merge. At --latency-scale 12 that regime is not
rollout-bound on a 2-core CPU: the CPU learner (about 2 s per 128-trajectory update, more while
it shares the cores with the rollouts) is the bottleneck, so repack's extra trajectories mostly
wait for it; at 24 the rollouts are (they never idle, the learner idles over half the time). The
emulated engine charges prefill too (the profile's 2e4 tokens/s, slowed like decode), so a move's
re-prefill costs what it would. Writes experiments/results/<--name>.{json,txt} and prints a table;
with --figures (the default) also the standard panels of every mode side by side, one PNG per
panel (`laminar_jax.plot`), under experiments/results/<--name>_figures/<engine>/.
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
    # prefill is slowed by the same factor as decode, so a (re-)prefill costs what it costs
    # against decode in the paper's profile
    profile = DecodeProfile(tp=1, batch=(1, 4, 8, 16, 32, 64, 128, 256),
                            latency_ms=(7.0, 7.3, 7.7, 8.4, 9.6, 12.6, 18.1, 29.6),
                            kv_capacity_tokens=8192, prefill_tokens_per_s=2e4 / scale, context_ref=256)
    return DecodeModel(profile, 256, overhead=scale)


def config(out_dir: str, name: str, model_dir: str, args, extra: dict):
    overrides = {"run.out_dir": out_dir, "run.name": name, "data.task": "countdown",
                 "run.steps": args.steps, "rollout.num_rollouts": args.rollouts,
                 "rollout.max_concurrency": args.concurrency, "learner.global_batch_groups": args.groups,
                 "data.group_size": 8, "manager.repack_interval_s": args.repack_interval,
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


def timeline(run_dir: str) -> dict:
    """Where a rollout's time goes, from the run folder: each trajectory runs on its rollout from
    the issue of its group (the "batch" event) to its finish, and on a repack destination from
    the move on. Returns the share of rollout-time spent advancing 1-4 trajectories (the tail
    phase), the mean number advanced when busy, the share idle, the moves' overhead (release to
    adopt) and how long a released rollout waits before its next batch."""
    run = load_run(run_dir)
    traj = run.trajectories
    ev = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    issued: dict = {}                                  # group -> (rollout, time) of its issue
    for e in ev:
        if e["kind"] == "batch":
            for gid in e.get("group_ids", ()):
                issued.setdefault(gid, (e["rollout"], e["t"]))
    moves: dict = {}
    for e in sorted((e for e in ev if e["kind"] == "repack"), key=lambda e: e["t"]):
        for gid in e.get("group_ids", ()):
            moves.setdefault(gid, []).append((e["t"], e["destination"]))
    segments: dict = {}                                # rollout -> [(start, end)]
    for t in traj.itertuples():
        where, start = issued.get(t.group_id, (t.rollout_id, t.t_issued))
        for when, dest in moves.get(t.group_id, ()):
            if when >= t.t_finished:
                break
            segments.setdefault(where, []).append((start, when))
            where, start = dest, when
        segments.setdefault(where, []).append((start, t.t_finished))
    if not segments:
        return {}
    lo = min(a for segs in segments.values() for a, _ in segs)
    hi = max(b for segs in segments.values() for _, b in segs)
    grid = np.arange(lo, hi, 0.01)
    tail, busy, idle, mean_n = [], [], [], []
    for segs in segments.values():
        a, b = np.array(segs).T
        n = ((a[None] <= grid[:, None]) & (grid[:, None] < b[None])).sum(1)
        tail.append(float(((n >= 1) & (n <= 4)).mean()))
        idle.append(float((n == 0).mean()))
        mean_n.append(float(n[n > 0].mean()) if (n > 0).any() else 0.0)
    waits = []
    batches = sorted((e["t"], e["rollout"]) for e in ev if e["kind"] == "batch" and e.get("fresh", True))
    for e in ev:
        if e["kind"] == "released":
            nxt = [t for t, r in batches if r == e["rollout"] and t >= e["t"]]
            if nxt:
                waits.append(nxt[0] - e["t"])
    over = [e["overhead_s"] for e in ev if e["kind"] == "repack" and "overhead_s" in e]
    return {"tail_frac": float(np.mean(tail)), "idle_frac": float(np.mean(idle)), "busy_batch": float(np.mean(mean_n)),
            "move_overhead_s": float(np.mean(over)) if over else None,
            "released_wait_s": float(np.mean(waits)) if waits else None,
            "moved_unfinished": int(sum(e.get("unfinished", 0) for e in ev if e["kind"] == "repack"))}


def mean_std(xs) -> tuple[float, float]:
    xs = np.asarray(xs, float)
    return float(xs.mean()), float(xs.std(ddof=1)) if len(xs) > 1 else 0.0


def paired_gain(a: list[float], b: list[float]) -> dict:
    """Relative gain of a over b, paired by repeat: mean of a_i / b_i - 1 with a two-sided 95%
    Student-t interval over the repeats (None with a single pair)."""
    g = np.asarray(a, float) / np.asarray(b, float) - 1.0
    mean, sd = mean_std(g)
    if len(g) < 2:
        return {"mean": mean, "lo": None, "hi": None, "n": len(g), "per_repeat": g.tolist()}
    from scipy import stats
    half = float(stats.t.ppf(0.975, len(g) - 1)) * sd / np.sqrt(len(g))
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": len(g), "per_repeat": g.tolist()}


def summarise(runs: dict) -> dict:
    """Per engine and mode: mean and std over the repeats of every scalar measure."""
    out: dict = {}
    for engine, rows in runs.items():
        out[engine] = {}
        for mode, reps in rows.items():
            keys = [k for k, v in reps[0].items() if isinstance(v, (int, float)) and v is not None]
            out[engine][mode] = {k: mean_std([r[k] for r in reps if r.get(k) is not None]) for k in keys}
            out[engine][mode]["repeats"] = len(reps)
        if "laminar" in rows and "laminar_no_repack" in rows:
            n = min(len(rows["laminar"]), len(rows["laminar_no_repack"]))
            lam, nor = rows["laminar"][:n], rows["laminar_no_repack"][:n]
            out[engine]["repack_gain"] = {k: paired_gain([r[k] for r in lam], [r[k] for r in nor])
                                          for k in ("tokens_per_s", "trajectories_per_s")}
    return out


def table(runs: dict) -> str:
    summary = summarise(runs)
    lines = []
    for engine, rows in summary.items():
        base = rows.get("sync")
        repeats = max(r["repeats"] for m, r in rows.items() if m != "repack_gain")
        lines.append(f"\n{engine} engine: mean +- std over {repeats} interleaved repeats (x sync: tokens/s, "
                     "the paper's throughput)")
        lines.append(f"{'mode':<18}{'traj/s':>14}{'tok/s':>14}{'x sync':>8}{'learner idle':>14}{'rollout idle':>14}"
                     f"{'stale mean':>12}{'moves':>7}{'tail 1-4':>10}{'busy batch':>12}{'move s':>8}"
                     f"{'released wait s':>17}")
        for mode, r in rows.items():
            if mode == "repack_gain":
                continue
            ratio = f"{r['tokens_per_s'][0] / base['tokens_per_s'][0]:.2f}" if base else "-"
            wait, move_s = r.get("released_wait_s"), r.get("move_overhead_s")
            tail, busy = r.get("tail_frac", (float("nan"),)), r.get("busy_batch", (float("nan"),))
            lines.append(f"{mode:<18}{r['trajectories_per_s'][0]:>7.1f} +-{r['trajectories_per_s'][1]:>4.1f}"
                         f"{r['tokens_per_s'][0]:>7.0f} +-{r['tokens_per_s'][1]:>4.0f}{ratio:>8}"
                         f"{r['learner_idle_pct'][0]:>13.0f}%{r['rollout_idle_pct'][0]:>13.0f}%"
                         f"{r['staleness_mean'][0]:>12.2f}{r['repack_moves'][0]:>7.1f}"
                         f"{100 * tail[0]:>9.0f}%{busy[0]:>12.1f}"
                         f"{(f'{move_s[0]:.2f}' if move_s else '-'):>8}{(f'{wait[0]:.2f}' if wait else '-'):>17}")
        gain = rows.get("repack_gain")
        if gain:
            for k, g in gain.items():
                ci = f"95% CI [{100 * g['lo']:+.1f}%, {100 * g['hi']:+.1f}%]" if g["lo"] is not None else "(one pair)"
                lines.append(f"repack gain, {k}: {100 * g['mean']:+.1f}% {ci} over {g['n']} paired repeats; "
                             f"per repeat: {' '.join(f'{100 * x:+.0f}%' for x in g['per_repeat'])}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="emulated,real")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--groups", type=int, default=4, help="prompt groups per learner step")
    p.add_argument("--concurrency", type=int, default=32, help="trajectories one rollout generates at once")
    p.add_argument("--repack-interval", type=float, default=0.25, help="seconds between repack rounds")
    p.add_argument("--latency-scale", type=float, default=4.0)
    p.add_argument("--learner-step-s", type=float, default=0.0,
                   help="emulated engine: each learner update lasts at least this long (0: as fast as the CPU)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every mode, interleaved: modes in order, then reversed (A B B A ...)")
    p.add_argument("--prime-steps", type=int, default=0,
                   help="first run this many steps of the first mode, unmeasured, to fill the compile cache")
    p.add_argument("--name", default="compare_modes", help="results file stem")
    p.add_argument("--out", default=os.path.join(ROOT, "experiments/results"))
    p.add_argument("--work", default="/tmp/laminar-compare-modes")
    p.add_argument("--figures", action=argparse.BooleanOptionalAction, default=True,
                   help="write the standard panels (laminar plot) of each engine's modes side by side, "
                        "from their last repeat, to <out>/<name>_figures/<engine>/<panel>.png")
    args = p.parse_args(argv)

    import ray

    # One persistent XLA cache for every actor of every run (Ray workers inherit this
    # environment): a CPU compile of a new learner or engine shape takes seconds, and where it
    # lands in a short run is chance; the priming run below fills the cache first.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(args.work, "jax-cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    from laminar_jax.runtime import cluster, driver, warm_up
    warm_cfg = config(args.work, "warm", None, args, {"sft.steps": 60})
    model_dir = warm_up.run(warm_cfg, os.path.join(args.work, "warm"))
    cluster.start(warm_cfg)
    runs: dict = {}
    path = os.path.join(args.out, f"{args.name}.json")
    modes = args.modes.split(",")
    try:
        if args.prime_steps:
            engine, mode = args.engines.split(",")[0], modes[0]
            cfg = config(args.work, f"prime-{int(time.time())}", model_dir,
                         argparse.Namespace(**{**vars(args), "steps": args.prime_steps}), MODES[mode])
            t0 = time.time()
            driver.run(cfg, latency_model=latency_model(args.latency_scale) if engine == "emulated" else None,
                       quiet=True)
            print(f"priming run ({engine} {mode}, {args.prime_steps} steps, not measured): {time.time() - t0:.0f} s",
                  flush=True)
        for rep in range(args.repeats):
            # counterbalanced: a slow drift of the shared machine's load hits every mode alike
            order = modes if rep % 2 == 0 else modes[::-1]
            for engine in args.engines.split(","):
                lat = latency_model(args.latency_scale) if engine == "emulated" else None
                for mode in order:
                    name = f"{engine}-{mode}-{int(time.time())}"
                    cfg = config(args.work, name, model_dir, args, MODES[mode])
                    t0 = time.time()
                    summary = driver.run(cfg, latency_model=lat, quiet=True,
                                         min_update_s=args.learner_step_s if engine == "emulated" else 0.0)
                    r = measure(summary["run_dir"], summary)
                    r.update(timeline(summary["run_dir"]))
                    r["run_dir"] = summary["run_dir"]
                    runs.setdefault(engine, {}).setdefault(mode, []).append(r)
                    print(f"[{rep + 1}/{args.repeats}] {engine:<9}{mode:<18} {r['trajectories_per_s']:6.1f} traj/s "
                          f"{r['tokens_per_s']:7.0f} tok/s learner idle {r['learner_idle_pct']:3.0f}% rollout idle "
                          f"{r['rollout_idle_pct']:3.0f}% moves {r['repack_moves']} "
                          f"tail {100 * r.get('tail_frac', 0):.0f}% "
                          f"({time.time() - t0:.0f} s)", flush=True)
                    os.makedirs(args.out, exist_ok=True)
                    with open(path, "w") as f:
                        json.dump({"args": vars(args), "summary": summarise(runs), "runs": runs}, f, indent=1)
    finally:
        ray.shutdown()
    text = table(runs)
    print(text)
    if args.figures:
        from laminar_jax.plot import plot_runs
        for engine, by_mode in runs.items():
            # one column per mode, in the order run: reward against wall-clock, throughput over
            # time, staleness histogram (Fig 10 style), KV use per rollout (Fig 9 style), repack
            # events on the timeline, learner and rollout idle fractions
            out = os.path.join(args.out, f"{args.name}_figures", engine)
            for png in plot_runs([rs[-1]["run_dir"] for rs in by_mode.values()], out):
                print(png)
    with open(os.path.join(args.out, f"{args.name}.txt"), "w") as f:
        f.write(" ".join(["python experiments/compare_modes.py", *(argv if argv is not None else sys.argv[1:])]) + "\n")
        f.write(text + "\n")
    return runs


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
