"""`laminar train`: the RL run, reading like the data-flow picture of DESIGN.md.

    prompts -> DataActor(PromptPool) -> RolloutWorkers -> DataActor(ExperienceBuffer) -> Learner
                                         ^   (stream partials -> PartialPool)                |
                              pull latest|                                        version+=1 |
                                        RelayWorkers <- chain <- master relay <- publish <---+
                                         RolloutManager: heartbeats, repack, failover

The driver starts the actors (`fleet.Fleet`), then, per learner step: ask the learner for one
iteration, kick the manager (repack right after a publish), gather rollout stats and events,
write the run folder (metrics/ and trajectories/ part files, events.jsonl, trackers) and print
a progress line. A model given as a preset (no `model.hf_path`) on a built-in task first gets the
supervised warm-up of `laminar sft` (real post-training starts from an SFT model), trained in a
process of its own while Ray starts (`runtime.warm_up`). An existing
run folder is resumed from its latest committed checkpoint, or refused, per `run.resume`
(`run_folder.plan`, decided before Ray starts); a resumed run drops the rows the folder holds
from the resumed step on, so every step and trajectory is logged once.
While the learner works on a step the driver checks liveness about once a second
(`runtime.liveness`): a run that cannot progress stops with a `LivenessError` saying why. Events
are rate-limited per kind and source (`EventLimiter`): a fault that repeats per group cannot
flood the run folder. A consumed trajectory staler than the mode's bound is a warning event and
a console line.

With `run.colocate` the same parts run in this process instead, without Ray (`runtime.colocated`,
its own loop over the same per-step logging, `runtime.step_log`).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import ray

from laminar_jax.data.tasks import TASKS
from laminar_jax.metrics import RunWriter
from laminar_jax.runtime import cluster, engines, progress, run_folder, warm_up
from laminar_jax.runtime.fleet import Fleet
from laminar_jax.runtime.events import EventLimiter
from laminar_jax.runtime.liveness import LivenessError, Watchdog
from laminar_jax.runtime.step_log import StepLog, log_events, resume_rows

POLL_S = 1.0            # liveness check period while a step runs
SAVE_TIMEOUT_S = 300.0  # the final checkpoint's start (device-to-host copy, a write in progress)


def _wait_step(pending: Any, watchdog: Watchdog, step: int) -> dict:
    """The step's result; meanwhile the liveness check runs every POLL_S (LivenessError)."""
    while True:
        ready, _ = ray.wait([pending], timeout=POLL_S)
        if ready:
            try:
                return ray.get(pending)
            except ray.exceptions.RayActorError:
                watchdog.check(step)   # learner.hosts > 1: names the learner host that died
                raise
        watchdog.check(step)


def _final_save(fleet: Fleet, step: int, run_dir: str) -> None:
    """The checkpoint after the last step, within SAVE_TIMEOUT_S, or an error that says what is kept."""
    try:
        ray.get(fleet.learner.save_checkpoint.remote(), timeout=SAVE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        done = run_folder.checkpoints(run_dir)
        resume = f"checkpoint {done[-1]}" if done else "step 0 (no checkpoint is complete)"
        raise LivenessError(
            f"the final checkpoint (after step {step}) did not finish within {SAVE_TIMEOUT_S:g} s; the "
            f"metrics and trajectories of every step are in {run_dir}, and a resume starts from "
            f"{resume}") from None


def run(cfg: Any, *, on_step: Callable[[int, Fleet, dict], None] | None = None,
        latency_model: Any = None, min_update_s: float = 0.0, quiet: bool = False, inputs: Any = None) -> dict:
    """Trains for `cfg.run.steps` learner steps (versions); returns the summary dict.

    inputs: `preflight.train_inputs(cfg)` when the caller has run it (the CLI): its dataset and
    prompt lengths are used instead of loading and encoding them again.
    on_step(step, fleet, metrics) is called after each step (tests kill rollouts from it).
    latency_model / min_update_s (benchmarks): every decode step lasts what the model gives, every
    learner update at least min_update_s, emulating accelerator-bound rollouts and learner.
    """
    run_dir = os.path.join(cfg.run.out_dir, cfg.run.name)
    plan = run_folder.plan(cfg, run_dir)  # refuses a folder it must not touch, before anything starts
    model_dir = cfg.model.hf_path
    engines.check_engines(cfg, model_dir)  # vLLM missing or the model's architecture: before the warm-up
    if cfg.env.name is not None:  # a bad environment fails here, not in every rollout
        from laminar_jax.env.registry import resolve_env
        resolve_env(cfg.env)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    say(plan.note)
    clock = progress.StartupClock(say)
    warm = None
    if model_dir is None and cfg.data.path is None and cfg.data.task in TASKS:
        warm = warm_up.WarmUp(cfg, run_dir)   # its own process, while Ray starts
    owns_ray = False
    if not cfg.run.colocate:   # a colocated run is one process: no Ray
        try:
            owns_ray = cluster.start(cfg)
        except BaseException:
            if warm is not None:
                warm.stop()
            raise
        clock.mark("ray", "ray up" if owns_ray else "ray (already running)")
    if warm is not None:
        try:
            model_dir = warm.result()
        except BaseException:
            warm.stop()
            if owns_ray:
                ray.shutdown()
            raise
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=model_dir))
        clock.mark("warm_up", "supervised warm-up done")
    writer = RunWriter(run_dir, cfg)
    stores: list[tuple[str, int]] = []   # (weight store, learner pid)
    try:
        if cfg.run.colocate:
            from laminar_jax.runtime import colocated
            return colocated.train(cfg, run_dir, model_dir, writer, say, on_step, clock, plan, inputs,
                                   min_update_s=min_update_s, latency_model=latency_model)
        return _train(cfg, run_dir, model_dir, writer, say, on_step, latency_model, min_update_s, clock, plan,
                      stores, inputs)
    finally:
        writer.close()
        # the learner removes its weight store on close; a crashed one leaves it behind
        for root, pid in stores:
            run_folder.remove_store(root, pid=pid)
        run_folder.clean_stale_stores(cfg.relay.store_dir)
        if owns_ray:
            ray.shutdown()


def _train(cfg, run_dir, model_dir, writer, say, on_step, latency_model, min_update_s, clock, plan,
           stores, inputs) -> dict:
    t0 = time.time()
    limit = EventLimiter(writer.log_event)
    events = lambda kind, **f: limit(kind, **{k: v for k, v in f.items() if k != "time"})  # noqa: E731
    fleet = Fleet.start(cfg, run_dir, model_dir, events=events, latency_model=latency_model,
                        min_update_s=min_update_s, resume=plan.resume, on_phase=clock.mark,
                        dataset=None if inputs is None else inputs.dataset,
                        prompt_lengths=None if inputs is None else inputs.prompt_lengths)
    for bad in fleet.bad_rows:
        writer.log_event("bad_row", source=bad.source, location=bad.location, reason=bad.reason)
    stores.append((ray.get(fleet.learner.weight_store.remote(), timeout=60).root,
                   ray.get(fleet.learner.pid.remote(), timeout=60)))
    start = ray.get(fleet.learner.current_version.remote())
    resume_rows(writer, start, say)
    # steps as in the metrics' `step` column (0-based); paths on their own line
    pools = ", ".join(f"{p.num_rollouts} {p.engine}" for p in cfg.rollout.pools_resolved())
    say(f"laminar train: mode {cfg.manager.mode}, {cfg.rollout.num_rollouts} rollouts ({pools}), relays "
        f"{'on' if cfg.relay.enabled else 'off'}, repack {'on' if cfg.manager.repack else 'off'}, "
        f"steps {start}..{cfg.run.steps - 1}")
    say(f"  model {model_dir or cfg.model.preset}\n  run folder {run_dir}")
    log = StepLog(cfg, writer, say, events)
    watchdog = Watchdog(cfg, fleet)
    pending = fleet.learner.step.remote() if start < cfg.run.steps else None
    try:
        for step in range(start, cfg.run.steps):
            out = _wait_step(pending, watchdog, step)
            if step == start:
                clock.mark("first_step", f"first RL step done (v{out['version']}); training")
            fleet.manager.kick.remote()
            # the learner starts its next iteration while this one is logged, unless a checkpoint
            # is due: then this step's rows go to disk first and the next step begins with the save
            due, last = bool(out.get("checkpoint_due")), step + 1 >= cfg.run.steps
            pending = fleet.learner.step.remote() if not (due or last) else None
            stats = fleet.live_stats()
            ledger = ray.get(fleet.data.accounting.remote())
            # relays are checked by their monitor thread (relay.check_interval_s)
            step_events = out["events"] + fleet.drain_events(check_relays=False)
            m = log.record(step, out, stats, ledger, step_events, fleet.relay_events)
            if due:
                # rows up to this step on disk before the save starts: a checkpoint never covers a
                # step whose rows a crash could lose
                writer.flush()
                if last:
                    _final_save(fleet, step, run_dir)
                else:
                    pending = fleet.learner.step.remote(checkpoint_first=True)
            log.close_step(step, m)
            if on_step is not None:
                on_step(step, fleet, m)
        accounting = ray.get(fleet.data.accounting.remote())
        counters = ray.get(fleet.manager.report.remote())["counters"]
    finally:
        log_events(events, fleet.stop())
        limit.flush()
    return log.summary(wall_s=time.time() - t0, accounting=accounting, counters=counters, run_dir=run_dir,
                       startup=clock.phases)
