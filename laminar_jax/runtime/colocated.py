"""`run.colocate: true`: the whole run in the driver's process, for small single-node runs.

    prompts -> DataActor -> RolloutWorker (a thread) -> DataActor -> Learner (a thread) --+
                                 ^                                                        |
                                 +------ InProcessWeights <------- publish, version += 1 <+

The same data actor, rollout worker and learner as `runtime.fleet`'s, as plain objects: no Ray,
no weight store or orbax write per version, no relay; a version reaches the rollout as host
arrays in memory (`weights.local`). What that saves is start-up (no Ray node, no actor
processes, one JAX import) and each step's publish-to-pull chain; what it gives up is
isolation: there is no rollout manager (no heartbeats, failover or repack: one rollout has
nothing to repack against), and a rollout that dies ends the run with its error within POLL_S.
`Config._check_colocate` says which configs can run this way.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from laminar_jax.rewards.registry import RewardScorer
from laminar_jax.runtime import compile_cache, engines
from laminar_jax.runtime.data_actor import DataActor
from laminar_jax.runtime.events import EventLimiter
from laminar_jax.runtime.fleet import RolloutSpawner, RunInputs
from laminar_jax.runtime.learner_actor import Learner
from laminar_jax.runtime.liveness import LivenessError, Watchdog
from laminar_jax.runtime.step_log import StepLog, log_events, resume_rows
from laminar_jax.weights.local import InProcessWeights
from rollout.worker import RolloutWorker

POLL_S = 1.0            # how often a waiting driver looks at the rollout thread
STOP_TIMEOUT_S = 60.0   # the rollout thread's end after stop() (one engine step, a reward in flight)


class OneRollout:
    """What the liveness check (`liveness.Watchdog`) reads of a rollout manager, for the one
    rollout of a colocated run: nothing replaces it."""

    def __init__(self, worker: Any, thread: threading.Thread):
        self.worker, self.thread = worker, thread

    def report(self) -> dict:
        alive = self.worker.failed is None and self.thread.is_alive()
        return {"counters": {}, "live": [self.worker.id] if alive else [], "stats": {}, "restarts": 0,
                "starting": [self.worker.id] if alive and self.worker.engine is None else [],
                "restartable": False}


@dataclass
class Colocated:
    """The run's parts in this process; `on_step` callbacks get it where a Ray run gives its Fleet."""

    cfg: Any
    data: Any
    learner: Any
    worker: Any
    weights: Any
    thread: threading.Thread
    bad_rows: list
    manager: OneRollout = field(init=False)   # the liveness check's view of the rollout
    watchdog: Watchdog = field(init=False)

    def __post_init__(self):
        self.manager = OneRollout(self.worker, self.thread)
        self.watchdog = Watchdog(self.cfg, self)

    @classmethod
    def start(cls, cfg: Any, run_dir: str, model_dir: str | None, *, resume: bool, on_phase: Callable,
              inputs: Any = None, min_update_s: float = 0.0, latency_model: Any = None,
              events: Callable | None = None) -> "Colocated":
        """The rollout thread starts first and waits for the first weights; the learner
        initialises meanwhile (its background precompile included) and publishes version 0."""
        compile_cache.enable(cfg.run.compile_cache)
        inp = RunInputs.of(cfg, model_dir, None if inputs is None else inputs.dataset,
                           None if inputs is None else inputs.prompt_lengths)
        data = DataActor(*inp.data_args(), **inp.data_kwargs(cfg))
        weights = InProcessWeights(engines.model_config(cfg, model_dir), cfg.model.rollout_dtype)
        scorer = RewardScorer(inp.reward)
        plan = RolloutSpawner(cfg, data, weights, model_dir, inp.tokenizer, scorer, kind=None, accelerators={},
                              nodes=[None], prefix="colocated", latency_model=latency_model).plan(0)
        worker = RolloutWorker(plan.rid, plan.cfg, data, weights, plan.factory, inp.tokenizer, scorer)
        thread = threading.Thread(target=worker.run, name=f"rollout-{plan.rid}", daemon=True)
        thread.start()
        if events is not None:
            events("rollout_started", rollout=plan.rid, pool=plan.pool.name, engine=plan.pool.engine,
                   accelerators=0.0)
        on_phase("rollouts", "rollout thread started (it waits for the first weights)")
        try:
            learner = Learner(cfg, run_dir, data, resume=resume, min_update_s=min_update_s, publisher=weights,
                              max_row_tokens=inp.reach)
            learner.publish()
        except BaseException:
            worker.stop()
            raise
        on_phase("learner", "learner ready")
        on_phase("publish", "first weights published; the rollout builds its engine")
        return cls(cfg, data, learner, worker, weights, thread, list(inp.dataset.bad_rows))

    def check(self, step: int) -> None:
        """LivenessError when the rollout thread died (nothing else makes this run's data), or
        for what the Ray run's driver also stops on (`liveness.verdict`: every prompt rejected,
        prompts exhausted, nothing produced for manager.liveness_timeout_s)."""
        failed = self.worker.failed
        if failed is None and not self.thread.is_alive():
            failed = "its thread ended"
        if failed is not None:
            raise LivenessError(f"step {step}: rollout {self.worker.id} died ({failed}); a colocated run "
                                f"(run.colocate) has one rollout and no manager to replace it")
        self.watchdog.check(step)

    def wait(self, pending: Any, step: int) -> dict:
        """The learner step's result; meanwhile `check` runs every POLL_S."""
        while True:
            try:
                return pending.result(timeout=POLL_S)
            except FutureTimeout:
                self.check(step)

    def stop(self) -> list[dict]:
        """Stops the rollout, then the learner (its step in flight ends at its next wait for
        data); returns the last events."""
        self.worker.stop()
        self.thread.join(STOP_TIMEOUT_S)
        events = self.worker.drain_events()
        return events + self.learner.close()   # it closes its publisher, the weights


def train(cfg: Any, run_dir: str, model_dir: str | None, writer: Any, say: Callable, on_step: Callable | None,
          clock: Any, plan: Any, inputs: Any, *, min_update_s: float = 0.0, latency_model: Any = None) -> dict:
    """`driver.run`'s loop for a colocated run; returns the summary."""
    t0 = time.time()
    limit = EventLimiter(writer.log_event)
    events = lambda kind, **f: limit(kind, **{k: v for k, v in f.items() if k != "time"})  # noqa: E731
    run = Colocated.start(cfg, run_dir, model_dir, resume=plan.resume, on_phase=clock.mark, inputs=inputs,
                          min_update_s=min_update_s, latency_model=latency_model, events=events)
    steps = ThreadPoolExecutor(1, thread_name_prefix="learner")   # shut down after run.stop()
    try:
        for bad in run.bad_rows:
            writer.log_event("bad_row", source=bad.source, location=bad.location, reason=bad.reason)
        start = run.learner.current_version()
        resume_rows(writer, start, say)
        say(f"laminar train: mode {cfg.manager.mode}, colocated (learner and 1 jax rollout in this "
            f"process), steps {start}..{cfg.run.steps - 1}")
        say(f"  model {model_dir or cfg.model.preset}\n  run folder {run_dir}")
        log = StepLog(cfg, writer, say, events)
        pending = steps.submit(run.learner.step) if start < cfg.run.steps else None
        for step in range(start, cfg.run.steps):
            out = run.wait(pending, step)
            if step == start:
                clock.mark("first_step", f"first RL step done (v{out['version']}); training")
            due, last = bool(out.get("checkpoint_due")), step + 1 >= cfg.run.steps
            pending = steps.submit(run.learner.step) if not (due or last) else None
            stats = [run.worker.stats()]
            m = log.record(step, out, stats, run.data.accounting(), out["events"] + run.worker.drain_events(), [])
            if due:   # this step's rows on disk before the save starts (as in driver._train)
                writer.flush()
                if last:
                    run.learner.save_checkpoint()
                else:
                    pending = steps.submit(run.learner.step, checkpoint_first=True)
            log.close_step(step, m)
            if on_step is not None:
                on_step(step, run, m)
        accounting = run.data.accounting()
    finally:
        log_events(events, run.stop())
        steps.shutdown(wait=True)
        limit.flush()
    return log.summary(wall_s=time.time() - t0, accounting=accounting, counters=None, run_dir=run_dir,
                       startup=clock.phases)
