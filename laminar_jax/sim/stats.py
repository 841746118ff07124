"""The simulator's statistics as pure functions of its records: snapshots in, fractions out.

`Sim` takes integrals (busy rollout-seconds, KV use x time, tokens, ...) at each learner update;
an interval's idle fractions, KV use and generation rate are differences of two snapshots, and a
run's summary and steady-state check are functions of the per-update rows alone.
"""
from __future__ import annotations

import math

import numpy as np

# steady-state check: largest fitted drift over the measured updates of the buffer occupancy
# (share of its capacity) and of the mean staleness (versions)
STEADY_OCCUPANCY = 0.5
STEADY_STALENESS = 1.0

SUMMARY_MEANS = ("rollout_idle_frac", "learner_idle_frac", "accelerator_idle_frac", "kv_use",
                 "gen_tokens_per_s", "staleness_mean")


def percentile_sorted(values: list[float], q: float) -> float:
    """np.percentile(values, q) (linear interpolation) of an ascending list, in plain python:
    the KV sampler calls it ~1e3 times per cell on a few hundred values, where numpy's
    per-call overhead was ~5% of a paper table."""
    pos = q / 100.0 * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def interval_stats(a: dict, b: dict, *, colocated: bool, rollout_tp: int, accelerators: int,
                   train_accelerators: int, num_rollouts: int) -> dict:
    """Idle fractions, KV use and generation rate between two snapshots a -> b.

    Snapshot keys (integrals since t=0): time, busy (rollout-s generating), kv (sum over rollouts
    of KV share x s), gen_tokens, alive (alive rollout-s), gen_role (s the shared accelerators
    spent as rollouts; colocated only), learner (s the learner computed). With dt = b - a and
    role = rollout-s available to generate:

        rollout_idle = 1 - busy / role
        learner_idle = 1 - learner / dt                  (0 when colocated: one role at a time)
        accelerator_idle = ((role - busy) tp + (dt - learner) train) / (accelerators dt)
                         = (role - busy) tp / (accelerators dt)   when colocated
        kv_use = kv / role,   gen_tokens_per_s = gen_tokens / dt
    """
    dt = b["time"] - a["time"]
    role = (b["gen_role"] - a["gen_role"]) * num_rollouts if colocated else b["alive"] - a["alive"]
    busy = b["busy"] - a["busy"]
    learner = b["learner"] - a["learner"]
    rollout_idle = 1.0 - busy / role if role > 0 else float("nan")
    if colocated:
        learner_idle = 0.0
        acc_idle = (role - busy) * rollout_tp / (accelerators * dt) if dt > 0 else 0.0
    else:
        learner_idle = 1.0 - learner / dt if dt > 0 else float("nan")
        acc_idle = (((role - busy) * rollout_tp + (dt - learner) * train_accelerators)
                    / (accelerators * dt)) if dt > 0 else float("nan")
    return {
        "rollout_idle_frac": rollout_idle,
        "learner_idle_frac": learner_idle,
        "accelerator_idle_frac": acc_idle,
        "kv_use": (b["kv"] - a["kv"]) / role if role > 0 else float("nan"),
        "gen_tokens_per_s": (b["gen_tokens"] - a["gen_tokens"]) / dt if dt > 0 else 0.0,
    }


def steady_state(steps: list[dict], *, warmup_steps: int, capacity: int) -> dict:
    """Whether the measured updates are a steady state, not a filling pipeline.

    Over the measured updates (after warm-up), fit a line to the buffer occupancy (buffered
    + held groups, at each update) and to the mean staleness per update. Steady iff the
    occupancy's fitted drift over the window stays within STEADY_OCCUPANCY of the buffer
    capacity and the staleness drift within STEADY_STALENESS versions: a buffer growing
    without bound, or staleness rising by about one per update, fails both.
    """
    meas = steps[warmup_steps:]
    if len(meas) < 2:
        return {"steady": len(meas) == 1, "occupancy_drift": 0.0, "staleness_drift": 0.0}
    x = np.arange(len(meas), dtype=np.float64)
    occ = np.array([s["buffer_groups"] + s["held_groups"] for s in meas], np.float64)
    stale = np.array([s["staleness_mean"] for s in meas], np.float64)
    span = float(x[-1])
    occ_drift = float(np.polyfit(x, occ, 1)[0]) * span / capacity
    stale_drift = float(np.polyfit(x, stale, 1)[0]) * span
    steady = abs(occ_drift) <= STEADY_OCCUPANCY and abs(stale_drift) <= STEADY_STALENESS
    return {"steady": bool(steady), "occupancy_drift": occ_drift, "staleness_drift": stale_drift}


def summarise(steps: list[dict], *, warmup_steps: int) -> dict:
    """Means over the measured per-update rows (after warm-up) [P §8 metric]: throughput and
    iteration time, each of SUMMARY_MEANS (NaN rows left out), the staleness maximum, and the
    buffer's mean occupancy. No measured rows: throughput NaN, not steady."""
    meas = steps[warmup_steps:]
    if not meas:
        return {"throughput": float("nan"), "steps": len(steps), "steady": False}
    out = {"throughput": float(np.mean([s["throughput"] for s in meas])),
           "steps": len(steps), "measured_steps": len(meas),
           "iteration_s": float(np.mean([s["iteration_s"] for s in meas]))}
    for key in SUMMARY_MEANS:
        vals = [s[key] for s in meas if not math.isnan(s[key])]
        out[key] = float(np.mean(vals)) if vals else float("nan")
    out["staleness_max"] = int(max(s["staleness_max"] for s in meas))
    out["buffer_groups_mean"] = float(np.mean([s["buffer_groups"] for s in meas]))
    out["held_groups_mean"] = float(np.mean([s["held_groups"] for s in meas]))
    return out
