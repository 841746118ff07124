"""The driver's liveness check: a run that cannot make progress stops with an error naming why,
within `manager.liveness_timeout_s`, instead of the learner's long stall timeout.

While the learner waits for groups, the driver calls `Watchdog.check` about once a second with

    data     DataActor.liveness()      ledger, exhausted pool, seconds since the last delivery,
                                       rejection or streamed partial
    manager  RolloutManager.report()   live / starting rollouts, whether a dead one is replaced
    waited   Learner.waiting()         seconds this step has waited for groups so far

and it raises `LivenessError` for, in this order:

    no rollout alive and none restartable                  at once
    every prompt rejected: a whole pass rejected, nothing ever delivered      at once
    prompts exhausted (data.max_epochs), nothing in flight or re-queued, the learner waiting
                                                           after EXHAUSTED_GRACE_S
    the learner waited > liveness_timeout_s and nothing produced for as long, no rollout compiling

"Nothing in flight" is checked for EXHAUSTED_GRACE_S so that a delivery on its way lands first.
"""
from __future__ import annotations

import time
from typing import Any

EXHAUSTED_GRACE_S = 3.0


class LivenessError(RuntimeError):
    """The run cannot make progress; the message says why and which setting to change."""


def verdict(data: dict, manager: dict, waited_s: float | None, *, cfg: Any, step: int,
            exhausted_for_s: float = 0.0) -> str | None:
    """Why the run cannot go on, or None. Pure: the inputs are the three reports above."""
    m = cfg.manager
    if not manager["live"] and not manager["restartable"]:
        return (f"no rollout is alive and none can be restarted (restarts used "
                f"{manager['restarts']} of manager.max_restarts={m.max_restarts}); "
                f"learner at step {step} of run.steps={cfg.run.steps}")
    if data["received"] == 0 and data["rejected"] >= max(1, data["num_prompts"]):
        return (f"every prompt was rejected ({data['rejected']} groups, none generated); first: "
                f"{data['first_rejection']} -- check rollout.max_new_tokens / learner.max_seq_len "
                f"against the prompt lengths")
    if data["exhausted"] and data["in_flight"] == 0 and data["requeued"] == 0 \
            and exhausted_for_s >= EXHAUSTED_GRACE_S and (waited_s or 0.0) >= EXHAUSTED_GRACE_S:
        return (f"prompts exhausted: data.max_epochs={data['max_epochs']} passes over "
                f"{data['num_prompts']} prompts ended at step {step}, before run.steps={cfg.run.steps} "
                f"({data['buffered']} groups buffered, the learner needs "
                f"{cfg.learner.global_batch_groups}); raise data.max_epochs or lower run.steps")
    limit = m.liveness_timeout_s
    if waited_s is not None and waited_s > limit and data["idle_s"] > limit and not manager["starting"]:
        return (f"the learner has waited {waited_s:.0f} s for groups at step {step} and no rollout "
                f"delivered, rejected or streamed anything for {data['idle_s']:.0f} s "
                f"(manager.liveness_timeout_s={limit:g}); live rollouts {manager['live']}, ledger "
                f"in_flight={data['in_flight']} requeued={data['requeued']} buffered={data['buffered']}")
    return None


class Watchdog:
    """`check(step)` polls the data actor, manager and learner (each call with a timeout) and
    raises LivenessError when `verdict` says so. They are Ray actors, or plain objects in this
    process (a colocated run: `runtime.colocated`)."""

    def __init__(self, cfg: Any, fleet: Any, *, call_timeout_s: float = 30.0):
        self.cfg, self.fleet, self.call_timeout_s = cfg, fleet, call_timeout_s
        self._exhausted_since: float | None = None
        self._unanswered_since: float | None = None

    def check(self, step: int) -> None:
        import ray

        from rollout.rpc import call

        f, t = self.fleet, self.call_timeout_s
        if len(getattr(f, "learner_hosts", ())) > 1:   # a dead learner host: LearnerHostError naming it
            from laminar_jax.runtime.learner_group import check_alive
            check_alive(f.learner_hosts, timeout_s=t)
        try:
            data = call(f.data.liveness, timeout=t)
            manager = call(f.manager.report, timeout=t)
            waited = call(f.learner.waiting, timeout=t)
        except ray.exceptions.GetTimeoutError:
            # a busy actor (start-up on a loaded machine): no verdict now, unless it lasts
            now = time.time()
            self._unanswered_since = self._unanswered_since or now
            limit = self.cfg.manager.liveness_timeout_s + self.cfg.manager.startup_grace_s
            if now - self._unanswered_since > limit:
                raise LivenessError(f"laminar train stopped: the data actor, manager or learner has not "
                                    f"answered for {now - self._unanswered_since:.0f} s") from None
            return
        self._unanswered_since = None
        drained = data["exhausted"] and data["in_flight"] == 0 and data["requeued"] == 0
        now = time.time()
        if not drained:
            self._exhausted_since = None
        elif self._exhausted_since is None:
            self._exhausted_since = now
        why = verdict(data, manager, waited, cfg=self.cfg, step=step,
                      exhausted_for_s=0.0 if self._exhausted_since is None else now - self._exhausted_since)
        if why is not None:
            raise LivenessError(f"laminar train stopped: {why}")
