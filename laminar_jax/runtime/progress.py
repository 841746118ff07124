"""Live progress lines and the end-of-run summary of `laminar train` (plain prints, no jax)."""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np


class RolloutMeter:
    """Per-step rollout idle fraction, KV use and generation tokens/s from the workers' counters."""

    def __init__(self):
        self._prev: dict[str, dict] = {}
        self._t = time.time()

    def update(self, stats: Sequence[dict]) -> dict[str, float]:
        now, d = time.time(), {"idle_s": 0.0, "busy_s": 0.0, "tokens": 0.0, "steps": 0.0, "kv_time": 0.0}
        for s in stats:
            prev = self._prev.get(s["id"], {k: 0.0 for k in d})
            for k in d:
                d[k] += s[k] - prev.get(k, 0.0)
            self._prev[s["id"]] = s
        wall, self._t = max(now - self._t, 1e-9), now
        total = d["idle_s"] + d["busy_s"]
        return {"rollout_idle_frac": d["idle_s"] / total if total else 1.0,
                "kv_use_mean": d["kv_time"] / d["steps"] if d["steps"] else 0.0,
                "gen_tokens_per_s": d["tokens"] / wall, "live_rollouts": float(len(stats))}


def step_line(step: int, total: int, m: dict[str, Any]) -> str:
    return (f"step {step + 1:>4}/{total}  v{int(m['version']):<4} reward {m['reward_mean']:.3f}  "
            f"len {m['response_len_mean']:5.1f}  stale mean {m['staleness_mean']:.2f} max {int(m['staleness_max'])}  "
            f"consumed {m['tokens_per_s']:7.0f} tok/s  gen {m.get('gen_tokens_per_s', 0):7.0f} tok/s  "
            f"idle learner {m['learner_idle_frac']:.0%} rollouts {m.get('rollout_idle_frac', 0):.0%}  "
            f"kv {m.get('kv_use_mean', 0):.0%}")


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
            "accounting": accounting, "manager": counters}


def summary_text(s: dict) -> str:
    if not s["steps"]:
        return "no learner step ran"
    a = s["accounting"]
    return (f"done: {s['steps']} steps in {s['wall_s']:.0f} s; mean reward {s['reward_first']:.3f} -> "
            f"{s['reward_last']:.3f}; staleness mean {s['staleness_mean']:.2f} max {int(s['staleness_max'])}; "
            f"{s['trajectories']} trajectories, {s['tokens_per_s']:.0f} consumed tok/s\n"
            f"ledger: issued {a['issued']} = consumed {a['consumed']} + buffered {a['buffered']} + in flight "
            f"{a['in_flight']} + requeued {a['requeued']} + dropped {a['dropped']} + rejected {a['rejected']}"
            f" (unaccounted {a['unaccounted']}); manager {s['manager']}")
