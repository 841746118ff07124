"""`laminar train`: the RL run, reading like the data-flow picture of DESIGN.md.

    prompts -> DataActor(PromptPool) -> RolloutWorkers -> DataActor(ExperienceBuffer) -> Learner
                                         ^   (stream partials -> PartialPool)                |
                              pull latest|                                        version+=1 |
                                        RelayWorkers <- chain <- master relay <- publish <---+
                                         RolloutManager: heartbeats, repack, failover

The driver starts the actors (`fleet.Fleet`), then, per learner step: ask the learner for one
iteration, kick the manager (repack right after a publish), gather rollout stats and events,
write the run folder (metrics.parquet, trajectories.parquet, events.jsonl, TensorBoard) and print
a progress line. While the learner works on a step the driver checks liveness about once a second
(`runtime.liveness`): a run that cannot progress stops with a `LivenessError` saying why. Events
are rate-limited per kind (`EventLimiter`): a fault that repeats per group cannot flood the run
folder. A consumed trajectory staler than the mode's bound is a warning event and console line.
A model given as a preset (no `model.hf_path`) on a built-in task first gets the
supervised warm-up of `laminar sft` (real post-training starts from an SFT model); a run folder
with a checkpoint resumes from it.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import ray

from laminar_jax.data.tasks import TASKS
from laminar_jax.metrics import RunWriter
from laminar_jax.manager import modes
from laminar_jax.runtime import cluster, progress
from laminar_jax.runtime.fleet import Fleet
from laminar_jax.runtime.liveness import Watchdog

POLL_S = 1.0            # liveness check period while a step runs
EVENT_WINDOW_S = 10.0   # per kind, at most EVENT_BURST events per window are written
EVENT_BURST = 50


class EventLimiter:
    """Writes at most `burst` events of one kind from one source (rollout or relay) per
    `window_s`; the rest are counted and written as one "events_suppressed" record (event,
    source, count) when the window closes."""

    def __init__(self, write: Callable[..., None], *, burst: int = EVENT_BURST,
                 window_s: float = EVENT_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.write, self.burst, self.window_s, self.clock = write, burst, window_s, clock
        self._windows: dict[tuple, list] = {}   # (kind, source) -> [window start, written, suppressed]

    def __call__(self, kind: str, **fields: Any) -> None:
        now = self.clock()
        key = (kind, fields.get("rollout") or fields.get("relay"))
        w = self._windows.get(key)
        if w is None or now - w[0] >= self.window_s:
            if w is not None and w[2]:
                self._suppressed(key, w[2])
            w = self._windows[key] = [now, 0, 0]
        if w[1] < self.burst:
            w[1] += 1
            self.write(kind, **fields)
        else:
            w[2] += 1

    def _suppressed(self, key: tuple, count: int) -> None:
        self.write("events_suppressed", event=key[0], source=key[1], count=count, window_s=self.window_s)

    def flush(self) -> None:
        for key, w in self._windows.items():
            if w[2]:
                self._suppressed(key, w[2])
                w[2] = 0


def warm_up(cfg: Any, run_dir: str) -> str:
    """Supervised warm-up into `<run_dir>/sft/sft_model` (reused when already there)."""
    model_dir = os.path.join(run_dir, "sft", "sft_model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        from laminar_jax.learner import sft
        sft_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=run_dir, name="sft",
                                                                   log_every=max(1, cfg.sft.steps // 10)))
        print(f"warm-up: {cfg.sft.steps} supervised steps on {cfg.data.task} before RL", flush=True)
        sft.run(sft_cfg)
    return model_dir


def _log_events(log: Callable[..., None], events: list[dict]) -> None:
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


def _wait_step(pending: Any, watchdog: Watchdog, step: int) -> dict:
    """The step's result; meanwhile the liveness check runs every POLL_S (LivenessError)."""
    while True:
        ready, _ = ray.wait([pending], timeout=POLL_S)
        if ready:
            return ray.get(pending)
        watchdog.check(step)


def run(cfg: Any, *, on_step: Callable[[int, Fleet, dict], None] | None = None,
        latency_model: Any = None, min_update_s: float = 0.0, quiet: bool = False) -> dict:
    """Trains for `cfg.run.steps` learner steps (versions); returns the summary dict.

    on_step(step, fleet, metrics) is called after each step (tests kill rollouts from it).
    latency_model / min_update_s (benchmarks): every decode step lasts what the model gives, every
    learner update at least min_update_s, emulating accelerator-bound rollouts and learner.
    """
    run_dir = os.path.join(cfg.run.out_dir, cfg.run.name)
    model_dir = cfg.model.hf_path
    if model_dir is None and cfg.data.path is None and cfg.data.task in TASKS:
        model_dir = warm_up(cfg, run_dir)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=model_dir))
    owns_ray = cluster.start(cfg)
    writer = RunWriter(run_dir, cfg)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    try:
        return _train(cfg, run_dir, model_dir, writer, say, on_step, latency_model, min_update_s)
    finally:
        writer.close()
        if owns_ray:
            ray.shutdown()


def _train(cfg, run_dir, model_dir, writer, say, on_step, latency_model, min_update_s) -> dict:
    t0 = time.time()
    limit = EventLimiter(writer.log_event)
    events = lambda kind, **f: limit(kind, **{k: v for k, v in f.items() if k != "time"})  # noqa: E731
    fleet = Fleet.start(cfg, run_dir, model_dir, events=events, latency_model=latency_model,
                        min_update_s=min_update_s)
    for bad in fleet.bad_rows:
        writer.log_event("bad_row", source=bad.source, location=bad.location, reason=bad.reason)
    start = ray.get(fleet.learner.current_version.remote())
    say(f"laminar train: mode {cfg.manager.mode}, {cfg.rollout.num_rollouts} rollouts, relays "
        f"{'on' if cfg.relay.enabled else 'off'}, repack {'on' if cfg.manager.repack else 'off'}, model "
        f"{model_dir or cfg.model.preset}, steps {start}..{cfg.run.steps}, run folder {run_dir}")
    meter, rows, stale_warnings = progress.RolloutMeter(), [], 0
    watchdog = Watchdog(cfg, fleet)
    pending = fleet.learner.step.remote() if start < cfg.run.steps else None
    try:
        for step in range(start, cfg.run.steps):
            out = _wait_step(pending, watchdog, step)
            fleet.manager.kick.remote()
            # the learner starts its next iteration while this one is logged
            pending = fleet.learner.step.remote() if step + 1 < cfg.run.steps else None
            m = dict(out["metrics"])
            m.update(meter.update(fleet.live_stats()))
            acc = ray.get(fleet.data.accounting.remote())
            m.update({f"ledger/{k}": v for k, v in acc.items()})
            writer.log_step(step, m)
            writer.log_trajectories(out["trajectories"])
            # relays are checked by their monitor thread (relay.check_interval_s)
            _log_events(events, out["events"] + fleet.drain_events(check_relays=False))
            warn = staleness_warning(cfg, step, m)
            if warn is not None:
                events("staleness_warning", **warn)
                if stale_warnings % 10 == 0:   # the console line at most every 10th such step
                    say(f"warning: step {step}: staleness_max {warn['staleness_max']:.0f} above the "
                        f"{cfg.manager.mode} bound {warn['bound']} (manager.max_staleness)")
                stale_warnings += 1
            rows.append(m)
            if step % cfg.run.log_every == 0 or step == cfg.run.steps - 1:
                say(progress.step_line(step, cfg.run.steps, m))
            if on_step is not None:
                on_step(step, fleet, m)
        accounting = ray.get(fleet.data.accounting.remote())
        counters = ray.get(fleet.manager.report.remote())["counters"]
    finally:
        _log_events(events, fleet.stop())
        limit.flush()
    summary = progress.summary(rows, wall_s=time.time() - t0, accounting=accounting, counters=counters)
    summary["run_dir"] = run_dir
    writer.log_event("summary", **{k: v for k, v in summary.items() if not isinstance(v, dict)})
    say(progress.summary_text(summary))
    return summary
