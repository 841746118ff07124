"""Where one learner step's wall time went (metrics `time/*`, the summary's `breakdown`).

The learner's timeline between the end of step k-1 and the end of step k is cut into

    rpc_gap      driver round trip: step k-1 returned, step k not yet started (minus checkpoint)
    checkpoint   orbax checkpoint after step k-1 (it delays step k; it waits for a publish write
                 in progress: one orbax save at a time per process, `orbax_saves`)
    wait_data    blocked in the data actor until the batch's groups were there
    batch        assembly of the padded batch + advantages (host)
    logprob      prox / ref log-prob recompute (learner compute)
    update       the optimizer update(s) (learner compute)
    publish      cast + device-to-host copy of the weights (a writer thread runs the orbax save)
    unaccounted  what is left: wall - the sum above (metrics, bookkeeping)

While the learner waits, the rollouts decode or do something else. Their own split (mean over
live rollouts, fractions of their time) is `time/rollout_{decode,pull,reload,rpc,reward,wait,
other}_frac`. Of `wait_data`, `wait_decode` is the part the rollouts can have spent decoding:
at most their decode seconds in the step (decode fraction x step wall); the rest,
`wait_rollout_overhead`, went to the weight path (relay latency, pulls, engine reloads), data
RPCs, rewards and idling. (A proportional split would be wrong in sync mode, where the rollouts
idle while the learner computes and decode while it waits.)

    overhead = wall - update - logprob - wait_decode          (everything but compute and decode)

Off the learner's path (in parallel, reported but not summed): the orbax write
(`time/publish_write_s`), the master relay's read + conversion (`time/relay_convert_s`) and the
chain's forward/receive (`time/relay_chain_s`).
"""
from __future__ import annotations

import time
from typing import Iterable, Sequence

import numpy as np

LEARNER_PARTS = ("rpc_gap_s", "checkpoint_s", "wait_data_s", "batch_s", "logprob_s", "update_s", "publish_s")
ROLLOUT_PARTS = ("decode_s", "pull_s", "reload_s", "rpc_s", "reward_s", "wait_s")
COMPUTE_PARTS = ("logprob_s", "update_s")


class Stopwatch:
    """Accumulates named durations: `clock = sw.add("update_s", clock)`."""

    def __init__(self):
        self.times = dict.fromkeys(LEARNER_PARTS, 0.0)

    def add(self, key: str, since: float) -> float:
        now = time.perf_counter()
        self.times[key] = self.times.get(key, 0.0) + now - since
        return now

    def learner_step(self, *, wall: float, gap: float, checkpoint: float) -> dict[str, float]:
        """`time/<part>` for the learner's parts and `time/unaccounted_s` = wall - their sum."""
        t = dict(self.times, checkpoint_s=checkpoint, rpc_gap_s=max(0.0, gap - checkpoint))
        out = {f"time/{k}": float(t[k]) for k in LEARNER_PARTS}
        out["time/step_wall_s"] = float(wall)
        out["time/unaccounted_s"] = float(wall - sum(t[k] for k in LEARNER_PARTS))
        return out


class InitClock:
    """Wall and CPU seconds (this process, all threads) per start-up phase of an actor:
    `mark(name)` closes the phase since the previous mark; `phases` holds `<name>_s` (wall) and
    `<name>_cpu_s`. On a shared 2-core machine the CPU seconds are the load-independent part."""

    def __init__(self):
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.phases[f"{name}_s"] = round(wall - self._wall, 4)
        self.phases[f"{name}_cpu_s"] = round(cpu - self._cpu, 4)
        self._wall, self._cpu = wall, cpu


def rollout_split(deltas: Sequence[dict]) -> dict[str, float]:
    """Mean fractions of the rollouts' time (busy_s + idle_s) in each part over one step.

    deltas: per live rollout, the increase of its counters since the previous step."""
    fracs = {f"time/rollout_{k[:-2]}_frac": [] for k in ROLLOUT_PARTS + ("other_s",)}
    for d in deltas:
        total = d.get("busy_s", 0.0) + d.get("idle_s", 0.0)
        if total <= 0:
            continue
        parts = {k: max(0.0, d.get(k, 0.0)) for k in ROLLOUT_PARTS}
        parts["other_s"] = max(0.0, total - sum(parts.values()))
        for k, v in parts.items():
            fracs[f"time/rollout_{k[:-2]}_frac"].append(v / total)
    return {k: float(np.mean(v)) if v else 0.0 for k, v in fracs.items()}


def overhead(m: dict) -> dict[str, float]:
    """Splits the learner's data wait into decode (at most the rollouts' decode seconds in the
    step) and the rest; overhead and its share of the step (see the module docstring). `m` holds
    the learner's and the rollouts' `time/*`."""
    wall = max(m["time/step_wall_s"], 1e-9)
    decode = m.get("time/rollout_decode_frac", 0.0)
    if not np.isfinite(decode):
        decode = 0.0
    wait_decode = min(m["time/wait_data_s"], decode * wall)
    compute = sum(m[f"time/{k}"] for k in COMPUTE_PARTS)
    over = max(0.0, wall - compute - wait_decode)
    return {"time/wait_decode_s": wait_decode, "time/wait_rollout_overhead_s": m["time/wait_data_s"] - wait_decode,
            "time/compute_s": compute, "time/overhead_s": over, "time/overhead_frac": over / wall}


def relay_times(events: Iterable[dict]) -> dict[str, float]:
    """Seconds the relays spent on the versions in `events` (relay event records), per version:
    the master's read + conversion + checksum, and the slowest relay's forward/receive/serve."""
    convert, chain = {}, {}
    for e in events:
        v = e.get("version")
        if e.get("kind") == "master_restored":
            convert[v] = sum(float(e.get(k, 0.0)) for k in ("read_s", "convert_s", "checksum_s"))
        elif e.get("kind") == "relay_received":
            s = sum(float(x) for k, x in e.items() if k.endswith("_s") and isinstance(x, (int, float)))
            chain[v] = max(chain.get(v, 0.0), s)
    out = {}
    if convert:
        out["time/relay_convert_s"] = float(np.mean(list(convert.values())))
    if chain:
        out["time/relay_chain_s"] = float(np.mean(list(chain.values())))
    return out


def summarise(rows: Sequence[dict], *, skip: int = 2) -> dict[str, float]:
    """Means of every `time/*` metric over the steps after the first `skip` (compiles). Means,
    not medians: the parts of the mean step add up to the mean step wall time."""
    steady = list(rows[skip:]) or list(rows)
    keys = sorted({k for r in steady for k in r if k.startswith("time/") and k != "time/unix_s"})
    vals = {k: [r[k] for r in steady if k in r and np.isfinite(r[k])] for k in keys}   # NaN: not logged that step
    out = {k[5:]: float(np.mean(v)) for k, v in vals.items() if v}
    if "step_wall_s" in out and "overhead_s" in out:   # of the mean step (a mean of ratios is not)
        out["overhead_frac"] = out["overhead_s"] / max(out["step_wall_s"], 1e-9)
    return out
