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
from laminar_jax.rewards.health import RewardWatch
from laminar_jax.runtime import breakdown, cluster, engines, progress, run_folder, warm_up
from laminar_jax.runtime.fleet import Fleet
from laminar_jax.runtime.events import EventLimiter
from laminar_jax.runtime.liveness import LivenessError, Watchdog

POLL_S = 1.0            # liveness check period while a step runs
SAVE_TIMEOUT_S = 300.0  # the final checkpoint's start (device-to-host copy, a write in progress)


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


# per-step metrics the summary needs (the full rows are on disk: memory stays flat in run length)
_SUMMARY_KEYS = ("reward_mean", "exact_rate", "staleness_mean", "staleness_max", "consumed_trajectories",
                 "tokens_per_s")


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
    writer.rewind(start)  # rows of steps after the checkpoint (a crashed run's) are redone
    stored = -1 if writer.last_step is None else writer.last_step
    if start > 0 and stored < start - 1:  # a crash lost rows the checkpoint had already covered
        writer.log_event("rows_missing", first_step=stored + 1, last_step=start - 1)
        say(f"warning: the run folder lacks the metrics of steps {stored + 1}..{start - 1} (lost in a crash "
            f"before they were written); checkpoint v{start} resumes after them")
    # steps as in the metrics' `step` column (0-based); paths on their own line
    pools = ", ".join(f"{p.num_rollouts} {p.engine}" for p in cfg.rollout.pools_resolved())
    say(f"laminar train: mode {cfg.manager.mode}, {cfg.rollout.num_rollouts} rollouts ({pools}), relays "
        f"{'on' if cfg.relay.enabled else 'off'}, repack {'on' if cfg.manager.repack else 'off'}, "
        f"steps {start}..{cfg.run.steps - 1}")
    say(f"  model {model_dir or cfg.model.preset}\n  run folder {run_dir}")
    meter, rows, stale_warnings = progress.RolloutMeter(), [], 0
    watchdog = Watchdog(cfg, fleet)
    watch = RewardWatch(max_error_rate=cfg.reward.max_error_rate, error_window=cfg.reward.error_window)
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
            m = dict(out["metrics"], **{"time/unix_s": time.time()})   # when the step ended (benchmarks)
            stats = fleet.live_stats()
            m.update(meter.update(stats))
            for line in watch.update(stats):  # reward failures: console, and a stop past the rate
                say(line)
            watch.check()
            # per-rollout KV use now, and the step's wall clock (the timeline of `laminar plot`)
            m.update({f"kv_use/{st['id']}": float(st["kv_used"]) for st in stats}, wall_time=time.time())
            acc = ray.get(fleet.data.accounting.remote())
            m.update({f"ledger/{k}": v for k, v in acc.items()})
            # relays are checked by their monitor thread (relay.check_interval_s)
            step_events = out["events"] + fleet.drain_events(check_relays=False)
            m.update(breakdown.relay_times(fleet.relay_events))
            m.update(breakdown.overhead(m))
            writer.log_step(step, m)
            writer.log_trajectories(out["trajectories"], step=step)
            _log_events(events, step_events)
            if due:
                # rows up to this step on disk before the save starts: a checkpoint never covers a
                # step whose rows a crash could lose
                writer.flush()
                if last:
                    _final_save(fleet, step, run_dir)
                else:
                    pending = fleet.learner.step.remote(checkpoint_first=True)
            warn = staleness_warning(cfg, step, m)
            if warn is not None:
                events("staleness_warning", **warn)
                if stale_warnings % 10 == 0:   # the console line at most every 10th such step
                    say(f"warning: step {step}: staleness_max {warn['staleness_max']:.0f} above the "
                        f"{cfg.manager.mode} bound {warn['bound']} (manager.max_staleness)")
                stale_warnings += 1
            rows.append({k: v for k, v in m.items() if k in _SUMMARY_KEYS or k.startswith("time/")})
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
    summary["startup"] = clock.phases
    writer.log_event("startup", **clock.phases)
    if rows:  # exact answers (full reward), first and last quarter of the steps like the reward
        k = max(1, len(rows) // 4)
        summary["exact_rate_first"] = float(sum(r["exact_rate"] for r in rows[:k]) / k)
        summary["exact_rate_last"] = float(sum(r["exact_rate"] for r in rows[-k:]) / k)
    # the events table stays flat: the ledger's counts as accounting_<key> columns
    writer.log_event("summary", **{k: v for k, v in summary.items() if not isinstance(v, dict)},
                     **{f"accounting_{k}": v for k, v in (accounting or {}).items() if isinstance(v, (int, float))})
    say(progress.summary_text(summary))
    if rows:
        say(f"exact answers: {summary['exact_rate_first']:.0%} -> {summary['exact_rate_last']:.0%} of trajectories")
    return summary
