"""Laminar: trajectory-level asynchrony with relays and repack [P §3-§5].

Each rollout takes a batch of `max_concurrency` trajectories (whole groups), drains it on one
weight version, then pulls the newest version its local relay holds (`Sim.relay_version`, the
chain time model of `laminar_jax.weights.chain`); the learner stalls only for the publish.
Rules from the runtime's pure functions: `modes.may_pull_weights`, `modes.repacks` and the
repack plan `laminar_jax.manager.repack.plan` (Algorithm 1), run every `repack.interval_s` and
after each publish; moved trajectories keep their version. Without relays a publish waits for
a global sync barrier: every rollout drains its batch first, as GPU-direct sync without weight
buffers would [P §2.4]. A lost machine's trajectories go to rollouts on the same version (the
partial response pool) [P §7].
"""

from __future__ import annotations

from laminar_jax.manager import modes
from laminar_jax.manager.repack import RolloutLoad, plan
from laminar_jax.sim import models
from laminar_jax.sim.policy_base import Policy, split_evenly

__all__ = ["Laminar"]


class Laminar(Policy):
    """Trajectory-level asynchrony with relays and repack [P §3-§5]."""

    def __init__(self, sim):
        super().__init__(sim)
        self.relays = self.system.relays
        self.repack = modes.repacks(sim.mode, enabled=self.system.repack)
        self.pending: int | None = None     # relays off: version waiting for the barrier
        self.barrier = False
        self.rp = sim.cfg.repack
        self.moves_kv = self.rp.transfer == "kv"
        # max_staleness (None = observed, the paper's): a rollout takes fresh trajectories only
        # while their global batch is at most `bound` versions past its weights
        # (`modes.bounded_issue_limit`); the buffer drops the few that finish later still
        self.bound = modes.issue_bound(sim.mode, max_staleness=self.system.max_staleness)
        sim.buffer.max_staleness = self.bound
        self.gated: list = []               # rollouts waiting for the learner to advance
        self.pulling = 0                    # rollouts loading a version (they ask next)
        self.waking = 0                     # gated rollouts being woken by a publish, not yet asked

    def start(self):
        for r in self.sim.rollouts:
            self.next_batch(r)
        if self.repack:
            self.sim.push(self.rp.interval_s, self._tick)

    # ---------------------------------------------------------------- rollout lifecycle
    def next_batch(self, r) -> None:
        sim = self.sim
        if not r.alive:
            return
        # drained, or released by repack / recovery with its trajectories already handed off
        if not modes.may_pull_weights(sim.mode, in_flight=r.unfinished(), released=False):
            raise RuntimeError(f"rollout {r.idx} asked for new weights with "
                               f"{r.unfinished()} trajectories in flight")
        if not self.relays and self.pending is not None:
            r.phase = "wait"
            self._check_barrier()
            return
        if r.held:                 # back-pressure: no new prompts until its groups are in
            r.phase = "blocked"
            return
        if not self.relays:
            self._start_batch(r)
            return
        v, ready = sim.newest_version(r)
        if v > r.version:
            # the version may still travel down the chain: wait for it, then load it
            r.phase = "pull"
            self.pulling += 1
            sim.push(max(ready, sim.now) + sim.pull_time, self._pull_done, (r, v, sim.now))
        else:
            self._start_batch(r)

    def _pull_done(self, arg) -> None:
        r, v, asked = arg
        self.pulling -= 1
        if not r.alive or r.phase != "pull":
            return
        r.version = v
        wait = self.sim.now - asked
        self.sim.weight_waits.append(wait)
        self.sim.log("pull", rollout=r.idx, version=v, wait_s=wait)
        self._start_batch(r)

    def _start_batch(self, r) -> None:
        if r.held:
            r.phase = "blocked"
            return
        sim = self.sim
        take = self.system.max_concurrency
        # a dropped (stale) group never lands in a batch, so it does not push later ones back
        limit = modes.bounded_issue_limit(next_position=sim.issued - sim.buffer.dropped_trajectories,
                                          weight_version=r.version,
                                          global_batch=sim.B, bound=self.bound)
        if limit is not None:
            # the rollouts waiting for work (gated, or pulling the version that opened more)
            # share what is open instead of the first one taking it all and the rest idling
            asking = 1 + len(self.gated) + self.pulling + self.waking     # counters: O(1)
            limit = max(sim.gs, limit // asking // sim.gs * sim.gs) if limit >= sim.gs else limit
            # re-queued trajectories (a dead machine's) belong to batches already open
            take = min(take, len(sim.requeued) + limit)
            if take < sim.gs and not sim.requeued:
                r.phase = "gated"       # the bound: wait for the learner, then pull and retry
                self.gated.append(r)
                return
        r.phase = "run"
        sim.assign(r, sim.take_trajectories(take))

    def on_drained(self, r):
        if r.phase == "run":
            self.next_batch(r)

    def on_unblocked(self, r):
        if r.phase == "blocked":
            self.next_batch(r)

    # ---------------------------------------------------------------- learner (FIFO, the base's)
    def on_train_done(self, final):
        sim = self.sim
        if self.relays:
            stall = sim.wm.publish_stall_s
            sim.block_learner(stall)
            sim.publishes.append((sim.version, sim.now + stall))
            sim.push(sim.now + stall, self._after_publish)
        else:
            self.pending = sim.version
            sim.block_learner(float("inf"))
            self._check_barrier()

    def _after_publish(self, _=None) -> None:
        self.try_train()
        if self.gated:              # the new version opens one more global batch to them
            gated, self.gated = self.gated, []
            gated = [r for r in gated if r.alive and r.phase == "gated"]
            self.waking = len(gated)
            for r in gated:
                self.waking -= 1
                self.next_batch(r)
        if self.repack:
            self._repack()

    def _check_barrier(self) -> None:
        if self.pending is None or self.barrier:
            return
        if all(r.phase in ("wait", "blocked", "gated") for r in self.alive_rollouts()):
            self.barrier = True
            self.sim.push(self.sim.now + self.sim.sync_time, self._barrier_done)

    def _barrier_done(self, _=None) -> None:
        sim = self.sim
        v, self.pending, self.barrier = self.pending, None, False
        sim.learner_blocked_until = sim.now
        sim.log("global_sync", version=v)
        self.gated = []             # every rollout asks again below (gated ones re-queue)
        alive = self.alive_rollouts()
        self.waking = len(alive)    # they ask together: fair shares of what is open
        for r in alive:
            self.waking -= 1
            r.version = v
            self._start_batch(r)
        self.try_train()

    # ---------------------------------------------------------------- repack [P §5]
    def _tick(self, _=None) -> None:
        self._repack()
        self.sim.push(self.sim.now + self.rp.interval_s, self._tick)

    def _repack(self) -> None:
        sim = self.sim
        loads = []
        by_id = {}
        for r in self.alive_rollouts("run"):
            if r.incoming:
                continue
            r.advance(sim.now)
            use = r.kv() / r.cap
            loads.append(RolloutLoad(str(r.idx), r.version, use, r.kv_prev, r.unfinished()))
            by_id[str(r.idx)] = r
            r.kv_prev = use
        moves = plan(loads, c_max=self.rp.c_max, roofline_batch=self.rp.roofline_batch)
        for m in moves:
            src, dst = by_id[m.source], by_id[m.destination]
            self._move(src, dst)
            sim.log("repack", source=src.idx, destination=dst.idx, version=m.version)
            self.next_batch(src)

    def _move(self, src, dst) -> None:
        """Every unfinished trajectory of src goes to dst; those in a tool call follow at once,
        the others (and, with transfer "kv", their KV cache) after overhead_s."""
        ts = self.sim.ts
        ids = src.extract()
        for i in src.sleeping:
            ts.where[i] = dst.idx
            ts.repacks[i] += 1
        dst.sleeping |= src.sleeping
        src.sleeping = set()
        self.sim.reschedule(src)
        for i in ids:
            ts.repacks[i] += 1
        self._send(dst, ids, with_kv=self.moves_kv)

    def _send(self, dst, ids, *, with_kv: bool) -> None:
        """Trajectories reach dst after overhead_s (with their KV cache when with_kv)."""
        if ids:
            dst.incoming += len(ids)
            self.sim.push(self.sim.now + self.rp.overhead_s, self._arrive, (dst, ids, with_kv))

    def _arrive(self, arg) -> None:
        dst, ids, with_kv = arg
        sim = self.sim
        dst.incoming -= len(ids)
        if not dst.alive:
            sim.requeued.extend(sim.restart_orphans(ids))
            return
        if with_kv:
            dst.resident.update(ids)
        sim.assign(dst, ids)
        if sim.drained(dst):
            self.on_drained(dst)

    # ---------------------------------------------------------------- failures [P §7]
    def on_fail(self, dead, orphans, sleeping):
        """The dead machine's KV caches are gone: its trajectories re-prefill wherever they go."""
        sim = self.sim
        ts = sim.ts
        by_version: dict[int, list[int]] = {}
        fresh = []
        for i in orphans + sleeping:
            v = ts.gen_version[i]
            (by_version.setdefault(v, []) if v >= 0 else fresh).append(i)
        sleeping_set = set(sleeping)
        for v, ids in by_version.items():
            targets = [r for r in self.alive_rollouts("run") if r.version == v]
            if not targets:
                sim.requeued.extend(sim.restart_orphans(ids))
                continue
            targets.sort(key=lambda r: (r.kv(), r.idx))
            for r, share in split_evenly(ids, targets):
                moving = []
                for i in share:
                    if i in sleeping_set:
                        ts.where[i] = r.idx
                        r.sleeping.add(i)
                    else:
                        moving.append(i)
                self._send(r, moving, with_kv=False)
        for i in fresh:
            ts.where[i] = -1
        sim.requeued.extendleft(reversed(fresh))
        if not self.relays:
            self._check_barrier()

    def on_recover(self, back):
        sim = self.sim
        for r in back:
            r.phase = "idle"
            delay = models.relay_arrival(sim.wm, sim.chain_position(r.machine), len(sim.chain))
            sim.push(sim.now + delay, self.next_batch, r)
