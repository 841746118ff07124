"""What every scheduling policy of the simulator shares: the learner gate, FIFO training, and
spreading trajectories over rollouts.

A policy makes the scheduling decisions of one mode and calls back into the simulator core
(`laminar_jax.sim.engine.Sim`), which owns the mechanics (decode, tool calls, learner updates,
relays, failures, statistics). The core calls the hooks below.
"""

from __future__ import annotations

import numpy as np

from laminar_jax.sim import models

__all__ = ["Policy", "split_evenly"]


def split_evenly(ids, rollouts: list) -> list[tuple[object, list[int]]]:
    """(rollout, its share) pairs: `ids` in order, cut into len(rollouts) contiguous near-equal
    shares (the first ones one larger); rollouts with an empty share are left out."""
    if not rollouts:
        return []
    chunks = np.array_split(np.asarray(ids, dtype=np.int64), len(rollouts))
    return [(r, c.tolist()) for r, c in zip(rollouts, chunks) if len(c)]


class Policy:
    """Base of the mode policies. Hooks the core calls:

    start() once; on_drained(r) when rollout r has nothing left; on_group_done(g, r) when every
    trajectory of prompt group g has finished (the last one on rollout index r), which delivers
    it to the buffer (`deliver`); on_unblocked(r) when the last group rollout r held because
    the buffer was full has been delivered; on_train_done(final) after a learner update (or
    a mini-batch when final is False); refill(r) after each rollout event in modes that refill
    continuously; on_fail(dead, orphans, sleeping) when a machine dies with its rollouts, their
    running / waiting and tool-call trajectories; on_recover(back) when its rollouts return.
    """

    def __init__(self, sim):
        self.sim = sim
        self.system = sim.system
        self._wake_pending = False

    def start(self) -> None: raise NotImplementedError
    def on_drained(self, r) -> None: pass
    def on_train_done(self, final: bool) -> None: raise NotImplementedError
    def refill(self, r) -> None: pass
    def on_fail(self, dead, orphans, sleeping) -> None: raise NotImplementedError
    def on_recover(self, back) -> None: raise NotImplementedError

    def on_group_done(self, g, r_idx: int) -> None:
        """Deliver the finished group; the learner may start."""
        self.deliver(g, r_idx)
        self.try_train()

    def on_unblocked(self, r) -> None: pass

    def group_tag(self, g) -> int:
        """The buffer label of group g (global batch index in the global-batch modes)."""
        return -1

    def deliver(self, g, r_idx: int) -> bool:
        """Group g into the buffer (data.buffer_groups / buffer_when_full); a refused group is
        held by its rollout, which then takes no new prompts (back-pressure)."""
        sim = self.sim
        members = sim.ts.group_members[g]          # a range of consecutive ids
        rec = sim.buffer.record(g, min(sim.ts.gen_version[members.start:members.stop]),
                                self.group_tag(g))
        if sim.buffer.deliver(rec, r_idx):
            return True
        if r_idx >= 0:
            sim.rollouts[r_idx].held += 1
        return False

    def taken(self) -> None:
        """The learner took groups: retry the held ones; rollouts left with none resume."""
        sim = self.sim
        for _, r_idx in sim.buffer.retry():
            if r_idx < 0:
                continue
            r = sim.rollouts[r_idx]
            r.held -= 1
            if r.held == 0 and r.alive:
                self.on_unblocked(r)

    def try_train(self) -> None:
        self.train_fifo()

    # ---------------------------------------------------------------- learner
    def learner_free(self) -> bool:
        """Whether the learner may start work now. When it is blocked by a publish or a global
        sync, a retry of `try_train` is scheduled for the moment it is free."""
        sim = self.sim
        if sim.learner_busy:
            return False
        if sim.now >= sim.learner_blocked_until:
            return True
        if not self._wake_pending and sim.learner_blocked_until != float("inf"):
            self._wake_pending = True

            def wake(_):
                self._wake_pending = False
                self.try_train()

            sim.push(sim.learner_blocked_until, wake)
        return False

    def update_time(self, ids) -> float:
        """Seconds of one learner update on the global batch `ids` (in consumption order)."""
        sim = self.sim
        return models.train_time(sim.trajectory_tokens(ids), accelerators=sim.cell.train,
                                 model=sim.tm, mini_batch=sim.cfg.run.mini_batch)

    def group_ids(self, recs) -> list[int]:
        members = self.sim.ts.group_members
        out = []
        for rec in recs:
            out.extend(members[rec.group])
        return out

    def train_fifo(self) -> None:
        """Consume one global batch FIFO from the experience buffer when it holds one."""
        sim = self.sim
        if not self.learner_free():
            return
        # the staleness filter (partial's eta, laminar's max_staleness) frees room: retry the
        # held groups, which may be stale too, until nothing more is dropped
        while sim.buffer.drop_stale(sim.version):
            self.taken()
        recs = sim.buffer.take_fifo(sim.B // sim.gs)
        if recs is None:
            return
        ids = self.group_ids(recs)
        sim.start_train(ids, self.update_time(ids))
        self.taken()

    # ---------------------------------------------------------------- rollouts
    def alive_rollouts(self, phase: str | None = None) -> list:
        return [r for r in self.sim.rollouts if r.alive and (phase is None or r.phase == phase)]

    def reset_recovered(self, back, *, version: int, phase: str) -> None:
        """Rollouts back from a failure resume on `version` in `phase`."""
        for r in back:
            r.version = version
            r.phase = phase
