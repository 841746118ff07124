"""Staleness ablation: the same laminar run under every off-policy / staleness correction, at a
small and a large staleness, several seeds each, on the real runtime (`driver.run`, the path
`laminar train` takes: Ray actors, JAX engines, relays, manager, learner).

Arms: one YAML each under configs/ablations/staleness/ (`laminar train
configs/ablations/staleness/<arm>.yaml` runs one cell). They differ from `none.yaml` only in
loss.* (zero_mismatch.yaml: in rollout.zero_mismatch):

    none         PPO anchor = trainer recompute (prox), no pi/mu weight: no correction
    bypass       PPO anchor = behaviour (engine) log-probs
    decoupled    prox anchor + untruncated pi_prox / mu per token (AReaL)
    tis_token    prox + min(pi_prox / mu, 2) per token
    tis_seq      prox + min(prod pi_prox / mu, 2) per sequence
    icepop       prox + masked IS in [0.5, 5] per token
    stale_cap    prox + tokens staler than 2 versions masked
    stale_decay  prox + weight 0.8 ** staleness
    vtrace       prox + V-trace weights, rho_bar = c_bar = 1
    m2po         prox + M2PO second-moment mask, tau 0.04
    zero_mismatch  `none` with rollout.zero_mismatch (behaviour == learner bit for bit)

Staleness levels (laminar mode: a rollout pulls the newest weights after each batch, and the
experience buffer's capacity bounds how far rollouts run ahead of the learner, so it sets the
staleness the learner sees; no extra knob is needed):

    small   data.buffer_groups = 1 global batch (the arms' YAML)
    large   data.buffer_groups = --large-buffer global batches (FIFO: each group waits that many
            learner steps in the buffer), manager.max_staleness raised to match
    sync    manager.mode sync: the on-policy reference (staleness 0; every correction is then the
            identity up to the engine-vs-learner mismatch), not part of the default --levels

The supervised warm-up runs once (`driver.warm_up`, into --work/warm) and every run starts RL from
that model (model.hf_path); one Ray cluster and the persistent XLA compile cache serve every run.
Runs go in sequence, cells interleaved (seed-major, arms in a rotating order) so a drift of the
shared machine's load hits every arm alike.

Per arm and level: final reward (mean reward_mean over the last quarter of the steps; mean over
seeds with a two-sided 95% Student-t interval), reward gain over the run (same-prompt-length
strata, `analysis.reward_gain`), wall-clock seconds until the 3-step rolling mean reward first
reaches --threshold (mean over the seeds that reached it, and how many did), mean / max
trajectory staleness and the staleness histogram (share of consumed trajectories per lag, last bin
open). Writes experiments/results/staleness_ablation.{json,txt,png} (--name changes the stem) and
keeps the run folders under --work (pandas: `laminar_jax.analysis.load_run`).

    python experiments/staleness_ablation.py --pilot            # 2 arms x 1 seed x 2 levels, timed
    python experiments/staleness_ablation.py --arms all --seeds 3
    python experiments/staleness_ablation.py --report-only      # table + figure from --work's runs
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from laminar_jax.analysis import find_runs, load_run, reward_gain  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARM_DIR = os.path.join(ROOT, "configs/ablations/staleness")
ARMS = ("none", "bypass", "decoupled", "tis_token", "tis_seq", "icepop", "stale_cap", "stale_decay",
        "vtrace", "m2po", "zero_mismatch")
LEVELS = ("small", "large", "sync")
HIST_BINS = 12          # staleness 0 .. 10, and 11+


def level_overrides(level: str, cfg, large_buffer: int) -> dict:
    """The config keys a staleness level sets on top of an arm's YAML."""
    if level == "small":
        return {}
    if level == "sync":      # the on-policy reference: the fleet generates one batch per version
        return {"manager.mode": "sync"}
    depth = large_buffer * cfg.learner.global_batch_groups
    return {"data.buffer_groups": depth, "manager.max_staleness": large_buffer + 4}


def arm_config(arm: str, level: str, seed: int, work: str, model_dir: str | None, args):
    from laminar_jax.config import load_config
    path = os.path.join(ARM_DIR, f"{arm}.yaml")
    base = load_config(path)
    over = {"run.out_dir": os.path.join(work, "runs"), "run.name": f"{level}-{arm}-s{seed}",
            "run.seed": seed, "run.trackers": "[]", "run.log_every": 1000,
            "relay.store_dir": "/dev/shm/laminar-ablation", **level_overrides(level, base, args.large_buffer)}
    if args.steps:
        over["run.steps"] = args.steps
    if model_dir is not None:
        over["model.hf_path"] = model_dir
    return load_config(path, [f"{k}={v}" for k, v in over.items()])


# ---------------------------------------------------------------- measures (pure, unit-tested)

# two-sided 95% Student-t quantiles t_{0.975, df}, df = 1..10 (scipy only beyond: importing it
# costs seconds on a loaded machine)
T975 = (12.706204736174694, 4.302652729749462, 3.1824463052837078, 2.7764451051977934, 2.5705818356363146,
        2.4469118511449786, 2.364624251592784, 2.306004135204166, 2.262157162798205, 2.228138851986274)


def t_interval(xs) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided 95% Student-t interval of the mean,
    mean +- t_{0.975, n-1} s / sqrt(n), s the unbiased std; (x, nan, nan) for a single value."""
    xs = np.asarray([x for x in xs if x is not None and not math.isnan(x)], float)
    if len(xs) == 0:
        return (math.nan, math.nan, math.nan)
    mean = float(xs.mean())
    if len(xs) < 2:
        return (mean, math.nan, math.nan)
    df = len(xs) - 1
    if df <= len(T975):
        t = T975[df - 1]
    else:
        from scipy import stats
        t = float(stats.t.ppf(0.975, df))
    half = t * float(xs.std(ddof=1)) / math.sqrt(len(xs))
    return (mean, mean - half, mean + half)


def diff_interval(a, b) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): the pooled two-sample 95% Student-t interval,
    d +- t_{0.975, na+nb-2} s_p sqrt(1/na + 1/nb), s_p^2 = ((na-1) s_a^2 + (nb-1) s_b^2) / (na+nb-2);
    nan bounds unless both sides have 2 values or more."""
    a, b = (np.asarray([x for x in v if not math.isnan(x)], float) for v in (a, b))
    if len(a) == 0 or len(b) == 0:
        return (math.nan, math.nan, math.nan)
    d = float(a.mean() - b.mean())
    df = len(a) + len(b) - 2
    if len(a) < 2 or len(b) < 2 or df > len(T975):
        return (d, math.nan, math.nan)
    sp = math.sqrt(((len(a) - 1) * a.var(ddof=1) + (len(b) - 1) * b.var(ddof=1)) / df)
    half = T975[df - 1] * sp * math.sqrt(1 / len(a) + 1 / len(b))
    return (d, d - half, d + half)


def elapsed(metrics: pd.DataFrame, events: pd.DataFrame) -> np.ndarray:
    """Seconds of each metrics row since the run's first event (its start), from wall_time."""
    t0 = min(float(events["time"].min()) if len(events) else np.inf, float(metrics["wall_time"].min()))
    return (metrics["wall_time"] - t0).to_numpy(float)


def time_to_threshold(t: np.ndarray, reward: np.ndarray, threshold: float, window: int = 3) -> float:
    """First t at which the trailing `window`-step mean of reward is >= threshold (nan: never)."""
    r = pd.Series(np.asarray(reward, float)).rolling(window, min_periods=window).mean().to_numpy()
    hit = np.flatnonzero(r >= threshold)
    return float(np.asarray(t, float)[hit[0]]) if len(hit) else math.nan


def staleness_hist(staleness, bins: int = HIST_BINS) -> list[float]:
    """Share of trajectories per staleness 0 .. bins-2, the last bin holding bins-1 and more."""
    s = np.minimum(np.asarray(staleness, int), bins - 1)
    counts = np.bincount(s, minlength=bins).astype(float)
    return (counts / max(1.0, counts.sum())).tolist()


def measure_run(path, threshold: float) -> dict:
    """One run folder's measures."""
    run = load_run(path)
    m, traj = run.metrics, run.trajectories
    n = len(m)
    q = max(1, n // 4)
    t = elapsed(m, run.events)
    r = m["reward_mean"].to_numpy(float)
    gain = reward_gain(traj)["gain"] if len(traj) else math.nan
    return {"run_dir": str(run.path), "steps": n, "wall_s": float(t[-1]) if n else math.nan,
            "reward_first": float(r[:q].mean()), "reward_final": float(r[-q:].mean()),
            "reward_gain_same_len": float(gain),
            "time_to_threshold_s": time_to_threshold(t, r, threshold),
            "staleness_mean": float(traj["staleness"].mean()), "staleness_max": int(traj["staleness"].max()),
            "staleness_hist": staleness_hist(traj["staleness"]),
            "mismatch_abs_mean": float(m["loss/mismatch_abs_mean"].mean()) if "loss/mismatch_abs_mean" in m else None,
            "masked_frac": float(m["loss/masked_frac"].mean()) if "loss/masked_frac" in m else None,
            "elapsed": t.tolist(), "reward": r.tolist()}


def summarise(cells: dict) -> dict:
    """cells[(level, arm)] = [measure_run(...) per seed] -> per level and arm: the table's values."""
    out: dict = {}
    for (level, arm), runs in sorted(cells.items()):
        final = t_interval([x["reward_final"] for x in runs])
        gain = t_interval([x["reward_gain_same_len"] for x in runs])
        reached = [x["time_to_threshold_s"] for x in runs if not math.isnan(x["time_to_threshold_s"])]
        hist = np.mean([x["staleness_hist"] for x in runs], axis=0)
        ref = cells.get((level, "none"), [])
        vs_none = diff_interval([x["reward_final"] for x in runs], [x["reward_final"] for x in ref])
        out.setdefault(level, {})[arm] = {
            "seeds": len(runs), "reward_final": final, "reward_final_minus_none": vs_none,
            "reward_gain_same_len": gain,
            "reward_first": float(np.mean([x["reward_first"] for x in runs])),
            "time_to_threshold_s": float(np.mean(reached)) if reached else math.nan,
            "reached_threshold": len(reached),
            "staleness_mean": float(np.mean([x["staleness_mean"] for x in runs])),
            "staleness_max": int(max(x["staleness_max"] for x in runs)),
            "staleness_hist": hist.tolist(), "wall_s": float(np.mean([x["wall_s"] for x in runs]))}
    return out


def table(summary: dict, threshold: float) -> str:
    lines = []
    for level, arms in summary.items():
        lines.append(f"\nstaleness level: {level}")
        lines.append(f"{'arm':<14}{'seeds':>6}{'final reward [95% CI]':>28}{'minus none [95% CI]':>28}"
                     f"{'gain (same len) [95% CI]':>30}"
                     f"{f't to {threshold:g} (s, n)':>20}{'stale mean/max':>16}  staleness hist % (0,1,2,...,{HIST_BINS - 1}+)")
        for arm, s in arms.items():
            f, g, dn = s["reward_final"], s["reward_gain_same_len"], s["reward_final_minus_none"]
            ci = (lambda v, sign="+": f"{v[0]:{sign}.3f} [{v[1]:{sign}.3f}, {v[2]:{sign}.3f}]" if not math.isnan(v[1])
                  else ("-" if math.isnan(v[0]) else f"{v[0]:{sign}.3f}"))
            ttt = f"{s['time_to_threshold_s']:.0f} ({s['reached_threshold']}/{s['seeds']})" \
                if s["reached_threshold"] else f"- (0/{s['seeds']})"
            hist = " ".join(f"{100 * h:.0f}" for h in s["staleness_hist"])
            lines.append(f"{arm:<14}{s['seeds']:>6}{ci(f, ''):>28}{('' if arm == 'none' else ci(dn)):>28}{ci(g):>30}{ttt:>20}"
                         f"{s['staleness_mean']:>10.2f}/{s['staleness_max']:<5}  {hist}")
    return "\n".join(lines)


def figure(cells: dict, path: str, threshold: float) -> None:
    """Reward (3-step rolling mean, averaged over seeds step by step) per arm, one column per
    staleness level: against wall-clock since the run's start (top; start-up and the shared
    machine's load move it) and against the learner step (bottom)."""
    from matplotlib.figure import Figure
    levels = [lv for lv in LEVELS if any(k[0] == lv for k in cells)]
    fig = Figure(figsize=(5.5 * len(levels), 7.5))
    axes = fig.subplots(2, len(levels), sharey=True, squeeze=False)
    colours = {arm: c for arm, c in zip(ARMS, [f"C{i}" for i in range(10)] + ["black"])}
    for col, level in enumerate(levels):
        for arm in ARMS:
            runs = cells.get((level, arm))
            if not runs:
                continue
            n = min(len(x["reward"]) for x in runs)
            t = np.mean([x["elapsed"][:n] for x in runs], axis=0)
            r = np.mean([pd.Series(x["reward"][:n]).rolling(3, min_periods=1).mean() for x in runs], axis=0)
            style = dict(color=colours[arm], lw=2.2 if arm in ("none", "tis_token") else 1.2,
                         ls="--" if arm == "zero_mismatch" else "-", label=f"{arm} ({len(runs)})")
            axes[0, col].plot(t, r, **style)
            axes[1, col].plot(np.arange(n), r, **style)
        for row in (0, 1):
            axes[row, col].axhline(threshold, color="gray", lw=0.6, ls=":")
        axes[0, col].set(title=f"{level} staleness", xlabel="wall-clock since run start (s)")
        axes[1, col].set(xlabel="learner step")
    for row in (0, 1):
        axes[row, 0].set_ylabel("reward (3-step rolling, seed mean)")
    axes[1, -1].legend(fontsize="x-small", loc="lower left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=70)


# ---------------------------------------------------------------- the study

def parse_cell(name: str) -> tuple[str, str, int] | None:
    """'large-tis_token-s2' -> ('large', 'tis_token', 2)."""
    level, _, rest = name.partition("-")
    arm, _, seed = rest.rpartition("-s")
    if level in LEVELS and arm in ARMS and seed.isdigit():
        return level, arm, int(seed)
    return None


def finished(path) -> bool:
    """The run wrote its end-of-run summary event."""
    events = pathlib.Path(path) / "events.jsonl"
    return events.is_file() and '"kind": "summary"' in events.read_text()


def collect(work: str, threshold: float) -> dict:
    cells: dict = {}
    root = os.path.join(work, "runs")
    for path in find_runs(root) if os.path.isdir(root) else []:
        cell = parse_cell(path.name)
        if cell is None or not (path / "metrics").is_dir():
            continue
        if not finished(path):     # running, or crashed: not a cell of the table
            continue
        run = measure_run(path, threshold)
        cells.setdefault(cell[:2], []).append(run)
    return cells


def schedule(arms, levels, seeds) -> list[tuple[str, str, int]]:
    """Seed-major; arms rotate by one per seed and the level order alternates, so no arm always
    runs first or last (the shared machine's load drifts)."""
    out = []
    for i, seed in enumerate(seeds):
        rot = list(arms[i % len(arms):]) + list(arms[:i % len(arms)])
        for arm in rot:
            for level in (levels if (i + arms.index(arm)) % 2 == 0 else levels[::-1]):
                out.append((level, arm, seed))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="all", help=f"comma list of {','.join(ARMS)}, or all")
    p.add_argument("--levels", default="small,large")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="learner steps per run (0: the YAMLs' run.steps)")
    p.add_argument("--large-buffer", type=int, default=6, help="large level: buffer depth in global batches")
    p.add_argument("--sft-steps", type=int, default=300, help="the one supervised warm-up's steps")
    p.add_argument("--threshold", type=float, default=0.75, help="reward threshold of the time-to-threshold column")
    p.add_argument("--pilot", action="store_true", help="none + tis_token, 1 seed, both levels; timed")
    p.add_argument("--report-only", action="store_true", help="no runs: table and figure from --work's run folders")
    p.add_argument("--deadline", default=None, help="unix time: start no run after it (the rest is reported as not run)")
    p.add_argument("--name", default="staleness_ablation", help="results file stem")
    p.add_argument("--out", default=os.path.join(ROOT, "experiments/results"))
    p.add_argument("--work", default="/tmp/laminar-staleness-ablation")
    args = p.parse_args(argv)
    arms = list(ARMS) if args.arms == "all" else args.arms.split(",")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.pilot:
        arms, seeds = ["none", "tis_token"], [args.first_seed]
    for a in arms:
        if a not in ARMS:
            p.error(f"--arms: unknown arm {a!r} (one of {', '.join(ARMS)})")
    levels = args.levels.split(",")
    timings: list[dict] = []
    skipped: list[str] = []
    if not args.report_only:
        import ray
        from laminar_jax.runtime import cluster, driver
        from laminar_jax.config import load_config
        warm_cfg = load_config(os.path.join(ARM_DIR, "none.yaml"),
                               [f"sft.steps={args.sft_steps}", f"run.out_dir={args.work}"])
        t0 = time.time()
        model_dir = driver.warm_up(warm_cfg, os.path.join(args.work, "warm"))
        print(f"warm-up: {time.time() - t0:.0f} s -> {model_dir}", flush=True)
        cluster.start(warm_cfg)
        try:
            plan = schedule(arms, levels, seeds)
            for k, (level, arm, seed) in enumerate(plan):
                name = f"{level}-{arm}-s{seed}"
                if os.path.isdir(os.path.join(args.work, "runs", name, "metrics")):
                    print(f"[{k + 1}/{len(plan)}] {name}: already in {args.work}, kept", flush=True)
                    continue
                if args.deadline and time.time() > float(args.deadline):
                    skipped.append(name)
                    continue
                cfg = arm_config(arm, level, seed, args.work, model_dir, args)
                t1 = time.time()
                s = driver.run(cfg, quiet=True)
                dt = time.time() - t1
                timings.append({"run": name, "seconds": dt})
                print(f"[{k + 1}/{len(plan)}] {name}: reward {s['reward_first']:.3f} -> {s['reward_last']:.3f} "
                      f"staleness {s['staleness_mean']:.2f}/{int(s['staleness_max'])} ({dt:.0f} s)", flush=True)
        finally:
            ray.shutdown()
    cells = collect(args.work, args.threshold)
    summary = summarise(cells)
    text = table(summary, args.threshold)
    if skipped:
        text += f"\n\nnot run (past --deadline): {', '.join(skipped)}"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name)
    command = " ".join(["python experiments/staleness_ablation.py", *(argv if argv is not None else sys.argv[1:])])
    with open(stem + ".json", "w") as f:
        json.dump({"command": command, "args": vars(args), "summary": summary, "timings": timings,
                   "not_run": skipped,
                   "runs": {f"{lv}/{arm}": runs for (lv, arm), runs in cells.items()}}, f, indent=1)
    with open(stem + ".txt", "w") as f:
        f.write(command + "\n" + text + "\n")
    if cells:
        figure(cells, stem + ".png", args.threshold)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
