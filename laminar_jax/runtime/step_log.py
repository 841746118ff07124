"""What the driver does with each learner step's result, whatever runs the step (Ray actors,
`runtime.fleet`, or one process, `runtime.colocated`): the step's metrics row with the
rollouts' stats, the ledger and the relays' times added; its trajectories and events in the run
folder; reward-failure and staleness warnings; the progress line; and, at the end, the summary.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from laminar_jax.manager import modes
from laminar_jax.rewards.health import RewardWatch
from laminar_jax.runtime import breakdown, progress

# per-step metrics the summary needs (the full rows are on disk: memory stays flat in run length)
_SUMMARY_KEYS = ("reward_mean", "exact_rate", "staleness_mean", "staleness_max", "consumed_trajectories",
                 "tokens_per_s")


def log_events(log: Callable[..., None], events: list[dict]) -> None:
    for e in events:
        e = dict(e)
        kind = e.pop("kind")
        e.pop("time", None)
        log(kind, **e)


def staleness_warning(cfg: Any, step: int, metrics: dict) -> dict | None:
    """The warning's fields when a consumed trajectory is staler than the mode's bound (laminar,
    unbounded by design: manager.max_staleness), else None."""
    bound = modes.staleness_bound(cfg.manager.mode, max_staleness=cfg.manager.max_staleness)
    bound = cfg.manager.max_staleness if bound is None else bound
    worst = metrics.get("staleness_max")
    if worst is None or worst <= bound:
        return None
    return dict(step=step, staleness_max=worst, staleness_mean=metrics.get("staleness_mean"), bound=bound,
                mode=cfg.manager.mode)


def resume_rows(writer: Any, start: int, say: Callable[..., None]) -> None:
    """Drops the rows of steps from `start` on (a crashed run's, redone) and says which rows a
    crash lost before the checkpoint the run resumes from."""
    writer.rewind(start)
    stored = -1 if writer.last_step is None else writer.last_step
    if start > 0 and stored < start - 1:  # a crash lost rows the checkpoint had already covered
        writer.log_event("rows_missing", first_step=stored + 1, last_step=start - 1)
        say(f"warning: the run folder lacks the metrics of steps {stored + 1}..{start - 1} (lost in a crash "
            f"before they were written); checkpoint v{start} resumes after them")


class StepLog:
    """`record` a step's row (before a due checkpoint starts), then `close_step` it; `summary`
    at the end. events(kind, **fields): the run's rate-limited event log."""

    def __init__(self, cfg: Any, writer: Any, say: Callable[..., None], events: Callable[..., None]):
        self.cfg, self.writer, self.say, self.events = cfg, writer, say, events
        self.meter, self.rows, self.stale_warnings = progress.RolloutMeter(), [], 0
        self.watch = RewardWatch(max_error_rate=cfg.reward.max_error_rate, error_window=cfg.reward.error_window)

    def record(self, step: int, out: dict, stats: list[dict], ledger: dict, step_events: list[dict],
               relay_events: list[dict]) -> dict:
        """Writes the step's row, trajectories and events; returns the row."""
        m = dict(out["metrics"], **{"time/unix_s": time.time()})   # when the step ended (benchmarks)
        m.update(self.meter.update(stats))
        for line in self.watch.update(stats):  # reward failures: console, and a stop past the rate
            self.say(line)
        self.watch.check()
        # per-rollout KV use now, and the step's wall clock (the timeline of `laminar plot`)
        m.update({f"kv_use/{st['id']}": float(st["kv_used"]) for st in stats}, wall_time=time.time())
        m.update({f"ledger/{k}": v for k, v in ledger.items()})
        m.update(breakdown.relay_times(relay_events))
        m.update(breakdown.overhead(m))
        self.writer.log_step(step, m)
        self.writer.log_trajectories(out["trajectories"], step=step)
        log_events(self.events, step_events)
        return m

    def close_step(self, step: int, m: dict) -> None:
        """The staleness warning, the summary's copy of the row and the progress line."""
        cfg = self.cfg
        warn = staleness_warning(cfg, step, m)
        if warn is not None:
            self.events("staleness_warning", **warn)
            if self.stale_warnings % 10 == 0:   # the console line at most every 10th such step
                self.say(f"warning: step {step}: staleness_max {warn['staleness_max']:.0f} above the "
                         f"{cfg.manager.mode} bound {warn['bound']} (manager.max_staleness)")
            self.stale_warnings += 1
        self.rows.append({k: v for k, v in m.items() if k in _SUMMARY_KEYS or k.startswith("time/")})
        if step % cfg.run.log_every == 0 or step == cfg.run.steps - 1:
            self.say(progress.step_line(step, cfg.run.steps, m))

    def summary(self, *, wall_s: float, accounting: dict | None, counters: dict | None, run_dir: str,
                startup: dict) -> dict:
        rows = self.rows
        summary = progress.summary(rows, wall_s=wall_s, accounting=accounting, counters=counters)
        summary["run_dir"] = run_dir
        summary["startup"] = startup
        self.writer.log_event("startup", **startup)
        if rows:  # exact answers (full reward), first and last quarter of the steps like the reward
            k = max(1, len(rows) // 4)
            summary["exact_rate_first"] = float(sum(r["exact_rate"] for r in rows[:k]) / k)
            summary["exact_rate_last"] = float(sum(r["exact_rate"] for r in rows[-k:]) / k)
        # the events table stays flat: the ledger's counts as accounting_<key> columns
        self.writer.log_event("summary", **{k: v for k, v in summary.items() if not isinstance(v, dict)},
                              **{f"accounting_{k}": v for k, v in (accounting or {}).items()
                                 if isinstance(v, (int, float))})
        self.say(progress.summary_text(summary))
        if rows:
            self.say(f"exact answers: {summary['exact_rate_first']:.0%} -> {summary['exact_rate_last']:.0%} "
                     f"of trajectories")
        return summary
