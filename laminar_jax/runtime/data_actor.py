"""The data module as one Ray actor: prompt pool, partial-response pool and experience buffer.

DESIGN.md draws them as three stores; they live in one CPU process here so that the operations
that touch two of them are atomic (a delivery puts the group in the buffer, completes it in the
pool's ledger and forgets its partials in one call; a checkpoint snapshots pool and buffer in
one call, pool first). Nothing here imports jax.

Mode policies (`manager.modes`) enter in two places only: which fresh groups a rollout on a
given weight version may take (`issue`), and which groups the learner gets (`sample`: FIFO, or
the groups of one global batch in the global-batch modes).
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Sequence

import ray

from laminar_jax.data.buffer import ExperienceBuffer, ledger_balance
from laminar_jax.data.partial_pool import PartialPool
from laminar_jax.data.prompt_pool import PromptPool
from laminar_jax.data.records import PartialTrajectory, PromptGroup, Trajectory
from laminar_jax.manager import modes


def group_position(group_id: str, num_prompts: int) -> int:
    """Cursor position of group "e{epoch}-{index}" (PromptPool's id scheme)."""
    epoch, index = group_id[1:].split("-")
    return int(epoch) * num_prompts + int(index)


class BatchSampler:
    """Sampler that picks the groups of one global batch (global-batch modes); `target` is set by
    the data actor before each `sample` call."""

    def __init__(self, num_prompts: int, global_batch: int):
        self.num_prompts, self.global_batch = num_prompts, global_batch
        self.target: int | None = None

    def in_target(self, group_id: str) -> bool:
        return modes.batch_of(group_position(group_id, self.num_prompts), self.global_batch) == self.target

    def select(self, groups, k):
        return [i for i, g in enumerate(groups) if self.in_target(g.group_id)][:k]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


CONCURRENCY_GROUPS = {"wait": 1}


def _serialised(cls):
    """Every public method runs under the actor's condition lock (the actor is threaded so that
    `wait_sample` can block while deliveries go on) and wakes the waiters when it returns."""
    def wrap(fn):
        @functools.wraps(fn)
        def locked(self, *args, **kwargs):
            with self._cond:
                out = fn(self, *args, **kwargs)
                self._cond.notify_all()
                return out
        return locked
    for name, fn in list(vars(cls).items()):
        if callable(fn) and not name.startswith("_") and name not in ("wait_sample", "wait_sample_hosts"):
            setattr(cls, name, wrap(fn))
    return cls


def host_parts(groups: list, hosts: int) -> list[list]:
    """The sampled groups split by learner host: host p gets the p-th contiguous equal part
    (whole groups, so per-group advantages stay on one host)."""
    if hosts < 1 or len(groups) % hosts:
        raise ValueError(f"{len(groups)} groups do not split over learner.hosts={hosts} "
                         f"(learner.global_batch_groups / learner.mini_batches must divide by it)")
    per = len(groups) // hosts
    return [list(groups[h * per:(h + 1) * per]) for h in range(hosts)]


@_serialised
class DataActor:
    """Prompt pool + partial pool + buffer with the mode's issue and sampling rules.

    `wait_sample` blocks the learner until enough groups are buffered (woken by every other
    call) in its own concurrency group ("wait", `CONCURRENCY_GROUPS`); every other method runs in
    the default group, one at a time in call order, and under the same lock.
    """

    def __init__(self, pool_kwargs: dict, buffer_kwargs: dict, *, mode: str, global_batch: int,
                 max_staleness: int | None):
        self._cond = threading.Condition(threading.RLock())
        self.mode = modes.check_mode(mode)
        self.global_batch = global_batch
        self.max_staleness = max_staleness
        self.pool = PromptPool(**pool_kwargs)
        self._batch_sampler = BatchSampler(self.pool.num_prompts, global_batch)
        if modes.uses_global_batches(mode):
            buffer_kwargs = dict(buffer_kwargs, sampler=self._batch_sampler)
        bound = modes.staleness_bound(mode, max_staleness=max_staleness)
        if modes.interrupts_on_publish(mode) and bound is not None:
            # AReaL's admission rule bounds staleness by issue position, but groups finish out of
            # order: one issued early and finished late can be consumed later than its batch. The
            # buffer drops such groups (counted as dropped in the ledger), so the bound holds.
            own = buffer_kwargs.get("max_staleness")
            buffer_kwargs = dict(buffer_kwargs, max_staleness=bound if own is None else min(own, bound))
        self.buffer = ExperienceBuffer(**buffer_kwargs)
        self.partials = PartialPool()
        self.learner_version = 0
        self.rejected: list[str] = []
        self.last_progress = time.time()   # a delivery, rejection or streamed partial (liveness)
        self._ticket, self._host_parts = 0, {}   # ticket -> {host: groups} (learner.hosts > 1)

    # ------------------------------------------------------------------ rollouts
    def issue(self, n: int, rollout_id: str, weight_version: int) -> list[PromptGroup]:
        """Up to n groups for a rollout on `weight_version`, within the mode's issue limit."""
        acc = self.pool.accounting()
        position = acc["epoch"] * acc["num_prompts"] + acc["index"]
        if modes.interrupts_on_publish(self.mode):
            # AReaL counts accepted submissions: a group dropped as stale (or evicted) never
            # reaches a batch, so it must not keep using the allowance (which would shrink for good)
            b = self.buffer.accounting()
            position -= b["dropped_stale"] + b["evicted"]
        # partial: count from the older of the learner's and the rollout's version (a rollout that
        # has not pulled the newest weights yet generates older tokens)
        limit = modes.fresh_issue_limit(self.mode, next_position=position, weight_version=weight_version,
                                        learner_version=min(self.learner_version, weight_version),
                                        global_batch=self.global_batch, max_staleness=self.max_staleness)
        # re-queued groups (a dead rollout's) belong to batches already open: always allowed
        if limit is not None:
            n = min(n, acc["requeued"] + limit)
        return self.pool.issue(n, rollout_id) if n > 0 else []

    def update_partials(self, partials: Sequence[PartialTrajectory]) -> int:
        live = [p for p in partials if self.pool.status(p.group_id) in ("in_flight", "requeued")]
        if live:
            self.last_progress = time.time()
        return self.partials.update(live)

    def deliver(self, trajectories: Sequence[Trajectory]) -> bool:
        """A finished group: into the buffer, completed in the ledger, partials forgotten.
        False = buffer full (back-pressure: the rollout keeps the group and retries)."""
        self.last_progress = time.time()   # back-pressured or not, its producer is alive
        if not self.buffer.put(trajectories):
            return False
        gid = trajectories[0].group_id
        self.pool.complete(gid)
        self.partials.drop_groups(gid)
        return True

    def reject(self, group_id: str, reason: str) -> None:
        """A group that cannot be generated (e.g. prompt longer than the context): completed in
        the ledger without entering the buffer, and listed in `accounting()['rejected']`."""
        self.pool.complete(group_id)
        self.partials.drop_groups(group_id)
        self.rejected.append(f"{group_id}: {reason}")
        self.last_progress = time.time()

    # ------------------------------------------------------------------ manager
    def reassign(self, group_ids: Sequence[str], rollout_id: str) -> None:
        self.pool.reassign([g for g in group_ids if self.pool.status(g) == "in_flight"], rollout_id)

    def orphans(self, rollout_id: str) -> tuple[list[PromptGroup], list[PartialTrajectory]]:
        """In-flight groups of a dead rollout and their streamed partials (taken from the pool)."""
        return self.pool.in_flight(rollout_id), self.partials.take_for(rollout_id)

    def requeue(self, group_ids: Sequence[str]) -> list[str]:
        """Back to the prompt pool, except groups the buffer already has (completed instead)."""
        seen = self.buffer.seen_among(list(group_ids))
        if seen:
            self.pool.complete(seen)
        rest = [g for g in group_ids if g not in seen]
        self.partials.drop_groups(rest)
        return self.pool.requeue(rest)

    # ------------------------------------------------------------------ learner
    def sample(self, num_groups: int, learner_version: int, batch_index: int | None = None) -> list[list[Trajectory]]:
        """`num_groups` whole groups (FIFO by default); with `batch_index`, groups of that global
        batch only. [] when not enough are there yet."""
        self.learner_version = max(self.learner_version, learner_version)
        if batch_index is not None:
            self._batch_sampler.target = batch_index
            have = sum(self._batch_sampler.in_target(g) for g in self.buffer.group_ids())
            if have < num_groups:
                return []
        return self.buffer.sample(num_groups, learner_version)

    @ray.method(concurrency_group="wait")
    def wait_sample(self, num_groups: int, learner_version: int, batch_index: int | None = None,
                    timeout_s: float = 1.0) -> list[list[Trajectory]]:
        """`sample`, blocking up to `timeout_s` until it has the groups ([] after that)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                groups = self.sample(num_groups, learner_version, batch_index)
                left = deadline - time.monotonic()
                if groups or left <= 0:
                    return groups
                self._cond.wait(left)

    @ray.method(concurrency_group="wait")
    def wait_sample_hosts(self, num_groups: int, learner_version: int, batch_index: int | None = None,
                          timeout_s: float = 1.0, hosts: int = 1) -> tuple[int, list] | None:
        """`wait_sample` for a learner over `hosts` hosts: samples the global batch, keeps every
        host's part (`host_parts`) and returns (ticket, host 0's part); the other hosts take
        theirs with `host_part(ticket, host)`. None after `timeout_s`."""
        groups = self.wait_sample(num_groups, learner_version, batch_index, timeout_s)
        if not groups:
            return None
        parts = host_parts(groups, hosts)
        with self._cond:
            self._ticket += 1
            self._host_parts[self._ticket] = {h: parts[h] for h in range(1, hosts)}
            return self._ticket, parts[0]

    def host_part(self, ticket: int, host: int) -> list[list[Trajectory]]:
        """Host `host`'s groups of the global batch `ticket` (each part is handed out once)."""
        parts = self._host_parts.get(ticket)
        if parts is None or host not in parts:
            raise KeyError(f"data actor: no part of batch {ticket} for learner host {host} "
                           f"(pending batches {sorted(self._host_parts)})")
        out = parts.pop(host)
        if not parts:
            del self._host_parts[ticket]
        return out

    def set_learner_version(self, version: int) -> None:
        self.learner_version = max(self.learner_version, int(version))

    # ------------------------------------------------------------------ bookkeeping
    def accounting(self) -> dict:
        pool, buffer = self.pool.accounting(), self.buffer.accounting()
        out = ledger_balance(pool, buffer)
        out["double_held"] += len(self.rejected)  # completed without a delivery, on purpose
        out.update(rejected=len(self.rejected), completed=pool["completed"], received=buffer["received"],
                   duplicates=buffer["duplicates"], reissues=pool["reissues"],
                   partials=len(self.partials), position=pool["epoch"] * pool["num_prompts"] + pool["index"])
        return out

    def liveness(self) -> dict:
        """What the driver's liveness check needs (`runtime.liveness`): the ledger, whether the
        pool is exhausted, seconds since the last delivery / rejection / streamed partial."""
        return dict(self.accounting(), exhausted=self.pool.exhausted(), num_prompts=self.pool.num_prompts,
                    max_epochs=self.pool.max_epochs, idle_s=time.time() - self.last_progress,
                    first_rejection=self.rejected[0] if self.rejected else None)

    def partial_stats(self) -> dict:
        return self.partials.stats()

    def state_dict(self) -> dict:
        """Pool before buffer (see PromptPool's docstring)."""
        return {"pool": self.pool.state_dict(), "buffer": self.buffer.state_dict(),
                "learner_version": self.learner_version, "rejected": list(self.rejected)}

    def load_state_dict(self, state: dict) -> None:
        self.pool.load_state_dict(state["pool"])
        self.buffer.load_state_dict(state["buffer"])
        self.learner_version = int(state["learner_version"])
        self.rejected = list(state.get("rejected", []))
