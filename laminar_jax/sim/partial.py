"""Partial rollout (AReaL): interruptible generation that refills continuously.

Rollouts keep up to `max_concurrency` trajectories in flight and take new groups whenever there
is room, gated by AReaL's submission bound `modes.may_submit` (eta = `max_staleness`, None =
unbounded as in the paper's throughput runs [P §8]). Every publish interrupts every rollout,
which loads the new version and re-prefills its running trajectories: trajectories span
versions, and `gen_version` is the version that started them.

The learner consumes complete groups in the order they completed: AReaL v0.3's trainer buffer
(`realhf/system/buffer.py`, `AsyncIOSequenceBuffer.get_batch_for_rpc`, "prioritize old data")
picks the samples with the earliest birth time, the time they entered the buffer, which is the
order the rollout workers finished them. (Ordering by the oldest gen_version instead would, with
eta unbounded, feed the learner the long trajectories started many versions ago first, and the
batches would drift to ever more tokens.)

weight_transfer "storage" (AReaL): the learner first writes the version to shared storage
(stalling), then every rollout is interrupted and reads it (stalling); "nccl": a global GPU
sync in which both sides stall.
"""

from __future__ import annotations

from laminar_jax.manager import modes
from laminar_jax.sim.policy_base import Policy

__all__ = ["Partial"]


class Partial(Policy):
    """AReaL-style partial rollout with interruptible generation."""

    def __init__(self, sim):
        super().__init__(sim)
        self.eta = modes.staleness_bound(sim.mode, max_staleness=self.system.max_staleness)
        self.submitted = 0
        # as the runtime's DataActor: groups finished so late that they are staler than eta
        # are dropped by the buffer, so the bound holds although completion is out of order
        sim.buffer.max_staleness = self.eta

    def start(self):
        for r in self.sim.rollouts:
            r.phase = "run"
            self.refill(r)
            self.sim.admit(r)
            self.sim.reschedule(r)

    def refill(self, r, share: int | None = None):
        """Take new groups while there is room and `may_submit` allows (at most `share`)."""
        sim = self.sim
        if not r.alive or r.phase != "run" or r.held:   # held: back-pressure, no new prompts
            return
        room = self.system.max_concurrency - r.unfinished()
        if room < sim.gs:           # the common case after every rollout event: full
            return
        if share is not None:
            room = min(room, share)
        ts = sim.ts
        # a dropped (stale) group never lands in a batch: it does not count as submitted
        while room >= sim.gs and modes.may_submit(self.submitted - sim.buffer.dropped_trajectories,
                                                  sim.version,
                                                  batch_size=sim.B, eta=self.eta):
            ids = sim.take_trajectories(sim.gs)
            for i in ids:
                ts.where[i] = r.idx
            r.waiting.extend(ids)
            self.submitted += len(ids)
            room -= len(ids)

    def on_unblocked(self, r):
        self.refill(r)
        self.sim.admit(r)
        self.sim.reschedule(r)

    # ---------------------------------------------------------------- learner (FIFO, the base's)
    def on_train_done(self, final):
        sim = self.sim
        if self.system.weight_transfer == "storage":
            # the learner writes the version; rollouts keep generating on the old one meanwhile
            write = sim.wm.bytes / sim.wm.storage_write_bytes_per_s
            sim.block_learner(write)
            sim.push(sim.now + write, self._interrupt,
                     sim.wm.bytes / sim.wm.storage_read_bytes_per_s)
        else:
            sim.block_learner(sim.sync_time)
            self._interrupt(sim.sync_time)

    def _interrupt(self, load_s: float) -> None:
        """Every rollout stops, loads the newest version (load_s) and re-prefills its work."""
        sim = self.sim
        ts = sim.ts
        # every rollout refills at once here: each gets a fair share of what the new version
        # opened (first come first served would hand it all to the first rollouts)
        share = None
        if self.eta is not None:
            open_ = ((sim.version + self.eta + 1) * sim.B
                     - (self.submitted - sim.buffer.dropped_trajectories))
            share = max(sim.gs, open_ // max(1, len(self.alive_rollouts())) // sim.gs * sim.gs)
        for r in self.alive_rollouts():
            r.advance(sim.now)
            ids = r.extract()
            for i in ids:
                if ts.gen_done[i] > 0:
                    ts.versions[i] += 1
            r.waiting.extend(ids)
            r.version = sim.version
            r.t_ref = max(r.t_ref, sim.now) + load_s
            if ids:
                r.load_int += load_s
            self.refill(r, share)
            sim.admit(r)
            sim.reschedule(r)
        sim.log("interrupt", version=sim.version)
        self.try_train()

    # ---------------------------------------------------------------- failures
    def _resume(self, rollouts) -> None:
        for r in rollouts:
            self.refill(r)
            self.sim.assign(r, [])

    def on_fail(self, dead, orphans, sleeping):
        sim = self.sim
        sim.requeued.extend(sim.restart_orphans(orphans + sleeping))
        self._resume(self.alive_rollouts("run"))

    def on_recover(self, back):
        sim = self.sim
        self.reset_recovered(back, version=sim.version, phase="run")
        for r in back:
            r.t_ref = sim.now + sim.pull_time
        self._resume(back)
