"""Live progress lines and the end-of-run summary of `laminar train` (plain prints, no jax)."""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from laminar_jax.runtime import breakdown

# what `step_line` prints must fit one terminal line; everything else is in the metrics
MAX_LINE = 120


class RolloutMeter:
    """Per-step rollout idle fraction, KV use and generation tokens/s from the workers' counters."""

    def __init__(self):
        self._prev: dict[str, dict] = {}
        self._t = time.time()

    def update(self, stats: Sequence[dict]) -> dict[str, float]:
        now, d = time.time(), {"idle_s": 0.0, "busy_s": 0.0, "tokens": 0.0, "steps": 0.0, "kv_time": 0.0}
        per_rollout = []
        for s in stats:
            prev = self._prev.get(s["id"], {})
            delta = {k: s.get(k, 0.0) - prev.get(k, 0.0) for k in tuple(d) + breakdown.ROLLOUT_PARTS}
            for k in d:
                d[k] += delta[k]
            per_rollout.append(delta)
            self._prev[s["id"]] = s
        wall, self._t = max(now - self._t, 1e-9), now
        total = d["idle_s"] + d["busy_s"]
        return {"rollout_idle_frac": d["idle_s"] / total if total else 1.0,
                "kv_use_mean": d["kv_time"] / d["steps"] if d["steps"] else 0.0,
                "gen_tokens_per_s": d["tokens"] / wall, "live_rollouts": float(len(stats)),
                **breakdown.rollout_split(per_rollout)}


class StartupClock:
    """The start-up line: `mark(key, text)` prints the seconds since the clock started and what
    just finished; `phases` keeps {key: seconds} for the summary (key None: printed only)."""

    def __init__(self, say, t0: float | None = None):
        self.say, self.t0 = say, time.time() if t0 is None else t0
        self.phases: dict[str, float] = {}

    def mark(self, key: str | None, text: str) -> float:
        elapsed = time.time() - self.t0
        if key is not None:
            self.phases[f"{key}_s"] = elapsed
        self.say(f"start-up {elapsed:5.1f} s: {text}"[:MAX_LINE])
        return elapsed


def step_line(step: int, total: int, m: dict[str, Any]) -> str:
    """One line (<= MAX_LINE characters) per logged step. `step` is the metrics' `step` column
    (0-based, so the last of `total` steps prints as total-1/total-1)."""
    line = (f"step {step:>4}/{total - 1} v{int(m['version'])} reward {m['reward_mean']:.3f} "
            f"len {m['response_len_mean']:.1f} stale {m['staleness_mean']:.2f}/{int(m['staleness_max'])} "
            f"{m['tokens_per_s']:.0f} tok/s gen {m.get('gen_tokens_per_s', 0):.0f} "
            f"idle L{m['learner_idle_frac']:.0%} R{m.get('rollout_idle_frac', 0):.0%} "
            f"{m.get('time/step_wall_s', 0):.2f}s/step ovh {m.get('time/overhead_frac', 0):.0%}")
    return line[:MAX_LINE]


def summary(rows: Sequence[dict], *, wall_s: float, accounting: dict, counters: dict) -> dict[str, Any]:
    """Reward before / after (means over the first and the last quarter of the steps: one
    step's mean reward varies a lot with the prompts drawn) and totals."""
    if not rows:
        return {"steps": 0, "wall_s": wall_s, "accounting": accounting}
    k = max(1, len(rows) // 4)
    r = [m["reward_mean"] for m in rows]
    stale = np.asarray([m["staleness_mean"] for m in rows])
    return {"steps": len(rows), "wall_s": wall_s, "reward_first": float(np.mean(r[:k])),
            "reward_last": float(np.mean(r[-k:])), "staleness_mean": float(stale.mean()),
            "staleness_max": float(max(m["staleness_max"] for m in rows)),
            "trajectories": int(sum(m["consumed_trajectories"] for m in rows)),
            "tokens_per_s": float(np.mean([m["tokens_per_s"] for m in rows])),
            "breakdown": breakdown.summarise(rows), "accounting": accounting, "manager": counters}


def summary_text(s: dict) -> str:
    if not s["steps"]:
        return "no learner step ran"
    a = s["accounting"]
    return (f"done: {s['steps']} steps in {s['wall_s']:.0f} s; mean reward {s['reward_first']:.3f} -> "
            f"{s['reward_last']:.3f}; staleness mean {s['staleness_mean']:.2f} max {int(s['staleness_max'])}; "
            f"{s['trajectories']} trajectories, {s['tokens_per_s']:.0f} consumed tok/s\n"
            f"ledger: issued {a['issued']} = consumed {a['consumed']} + buffered {a['buffered']} + in flight "
            f"{a['in_flight']} + requeued {a['requeued']} + dropped {a['dropped']} + rejected {a['rejected']}"
            f" (unaccounted {a['unaccounted']}); "
            + (f"manager {s['manager']}" if s["manager"] is not None else "no manager (run.colocate)")
            + breakdown_text(s.get("breakdown", {})))


def breakdown_text(b: dict) -> str:
    """The mean step's time split, one line (empty when there is none)."""
    if "step_wall_s" not in b:
        return ""
    parts = " + ".join(f"{k[:-2]} {b[k]:.3f}" for k in breakdown.LEARNER_PARTS + ("unaccounted_s",) if k in b)
    return (f"\nmean step {b['step_wall_s']:.3f} s = {parts}; decode {b.get('wait_decode_s', 0):.3f} of the wait;"
            f" overhead {b.get('overhead_frac', 0):.0%}")
