"""`laminar train`: the RL run, reading like the data-flow picture of DESIGN.md.

    prompts -> DataActor(PromptPool) -> RolloutWorkers -> DataActor(ExperienceBuffer) -> Learner
                                         ^   (stream partials -> PartialPool)                |
                              pull latest|                                        version+=1 |
                                        RelayWorkers <- chain <- master relay <- publish <---+
                                         RolloutManager: heartbeats, repack, failover

The driver starts the actors (`fleet.Fleet`), then, per learner step: ask the learner for one
iteration, kick the manager (repack right after a publish), gather rollout stats and events,
write the run folder (metrics.parquet, trajectories.parquet, events.jsonl, TensorBoard) and print
a progress line. A model given as a preset (no `model.hf_path`) on a built-in task first gets the
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
from laminar_jax.runtime import cluster, engines, progress
from laminar_jax.runtime.fleet import Fleet


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


def _log_events(writer: RunWriter, events: list[dict]) -> None:
    for e in events:
        e = dict(e)
        kind = e.pop("kind")
        e.pop("time", None)
        writer.log_event(kind, **e)


def run(cfg: Any, *, on_step: Callable[[int, Fleet, dict], None] | None = None,
        latency_model: Any = None, min_update_s: float = 0.0, quiet: bool = False) -> dict:
    """Trains for `cfg.run.steps` learner steps (versions); returns the summary dict.

    on_step(step, fleet, metrics) is called after each step (tests kill rollouts from it).
    latency_model / min_update_s (benchmarks): every decode step lasts what the model gives, every
    learner update at least min_update_s, emulating accelerator-bound rollouts and learner.
    """
    run_dir = os.path.join(cfg.run.out_dir, cfg.run.name)
    model_dir = cfg.model.hf_path
    engines.check_engines(cfg, model_dir)  # vLLM missing or the model's architecture: before the warm-up
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
    events = lambda kind, **f: writer.log_event(kind, **{k: v for k, v in f.items() if k != "time"})  # noqa: E731
    fleet = Fleet.start(cfg, run_dir, model_dir, events=events, latency_model=latency_model,
                        min_update_s=min_update_s)
    for bad in fleet.bad_rows:
        writer.log_event("bad_row", source=bad.source, location=bad.location, reason=bad.reason)
    start = ray.get(fleet.learner.current_version.remote())
    pools = ", ".join(f"{p.num_rollouts} {p.engine}" for p in cfg.rollout.pools_resolved())
    say(f"laminar train: mode {cfg.manager.mode}, {cfg.rollout.num_rollouts} rollouts ({pools}), relays "
        f"{'on' if cfg.relay.enabled else 'off'}, repack {'on' if cfg.manager.repack else 'off'}, model "
        f"{model_dir or cfg.model.preset}, steps {start}..{cfg.run.steps}, run folder {run_dir}")
    meter, rows = progress.RolloutMeter(), []
    pending = fleet.learner.step.remote() if start < cfg.run.steps else None
    try:
        for step in range(start, cfg.run.steps):
            out = ray.get(pending)
            fleet.manager.kick.remote()
            # the learner starts its next iteration while this one is logged
            pending = fleet.learner.step.remote() if step + 1 < cfg.run.steps else None
            m = dict(out["metrics"])
            m.update(meter.update(fleet.live_stats()))
            acc = ray.get(fleet.data.accounting.remote())
            m.update({f"ledger/{k}": v for k, v in acc.items()})
            writer.log_step(step, m)
            writer.log_trajectories(out["trajectories"])
            _log_events(writer, out["events"] + fleet.drain_events(check_relays=step % 10 == 0))
            rows.append(m)
            if step % cfg.run.log_every == 0 or step == cfg.run.steps - 1:
                say(progress.step_line(step, cfg.run.steps, m))
            if on_step is not None:
                on_step(step, fleet, m)
        accounting = ray.get(fleet.data.accounting.remote())
        counters = ray.get(fleet.manager.report.remote())["counters"]
    finally:
        _log_events(writer, fleet.stop())
    summary = progress.summary(rows, wall_s=time.time() - t0, accounting=accounting, counters=counters)
    summary["run_dir"] = run_dir
    writer.log_event("summary", **{k: v for k, v in summary.items() if not isinstance(v, dict)})
    say(progress.summary_text(summary))
    return summary
