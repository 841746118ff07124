"""Global-batch modes (sync, one_step, stream): the whole fleet generates one global batch on one
weight version, and a new version reaches the rollouts by a global sync.

Global batch k is generated on the newest version v with `modes.may_start_batch(k, v, bound)`,
split evenly over the alive rollouts. A global sync stalls every rollout and, without a weight
buffer (sync, one_step), the learner too [P §2.3]. sync may be colocated (verl): learner and
rollouts time-share all accelerators, paying `cluster.colocate_switch_s` per switch. stream
trains each mini-batch as soon as enough groups of its batch are done (FIFO) and keeps a weight
copy, so its learner is not stalled by the sync.
"""

from __future__ import annotations

from laminar_jax.manager import modes
from laminar_jax.sim import models
from laminar_jax.sim.policy_base import Policy, split_evenly

__all__ = ["GlobalBatch"]


class GlobalBatch(Policy):
    """sync / one_step / stream."""

    def __init__(self, sim):
        super().__init__(sim)
        self.bound = modes.staleness_bound(sim.mode, max_staleness=self.system.max_staleness)
        self.stream = modes.streams_minibatches(sim.mode)
        self.colocated = self.system.colocated
        self.k_gen = -1
        self.generating = False
        self.syncing = False
        self.active: set[int] = set()
        self.fleet_version = 0
        self.generated_k = -1
        self.batch_of: dict[int, int] = {}
        self.mb_next = 0

    def start(self):
        self._start_gen(0)

    # ---------------------------------------------------------------- generation
    def _dispatch(self, ids) -> None:
        """Spread `ids` over the alive rollouts; those given work count as active."""
        for r, share in split_evenly(ids, self.alive_rollouts()):
            r.phase = "run"
            self.active.add(r.idx)
            self.sim.assign(r, share)

    def _start_gen(self, k: int) -> None:
        sim = self.sim
        ids = sim.take_trajectories(sim.B)
        for i in ids[:: sim.gs]:
            self.batch_of[sim.ts.group[i]] = k
        self.k_gen = k
        self.generating = True
        self.active = set()
        if self.colocated:
            sim.set_gen_role(True)
        for r in self.alive_rollouts():
            r.version = self.fleet_version
        self._dispatch(ids)
        sim.log("batch_start", batch=k, version=self.fleet_version)

    def on_drained(self, r):
        if r.idx in self.active:
            self.active.discard(r.idx)
            r.phase = "wait"
            if not self.active:
                self._batch_generated()

    def _batch_generated(self) -> None:
        self.generating = False
        self.generated_k = self.k_gen
        if self.colocated:
            self.sim.set_gen_role(False)
        # a global sync first: without a weight buffer the learner takes part in it
        self._try_gen()
        self.try_train()

    def group_tag(self, g) -> int:
        return self.batch_of.pop(g)

    def on_group_done(self, g, r_idx):
        """The group joins the buffer labelled with its global batch (the runtime's
        BatchSampler picks by batch); stream may train a mini-batch at once."""
        self.deliver(g, r_idx)
        if self.stream:
            self.try_train()

    def _try_gen(self) -> None:
        sim = self.sim
        if self.generating or self.syncing:
            return
        if self.colocated and sim.learner_busy:
            return
        k = self.k_gen + 1
        v = sim.version
        if not modes.may_start_batch(k, v, bound=self.bound):
            return
        if v <= self.fleet_version:
            self._start_gen(k)
            return
        self.syncing = True
        t = sim.sync_time + (sim.cfg.cluster.colocate_switch_s if self.colocated else 0.0)
        if not self.stream:          # no weight buffer: the learner takes part in the sync
            sim.block_learner(t)
        for r in self.alive_rollouts():
            r.phase = "sync"
        sim.push(sim.now + t, self._sync_done, (k, v))

    def _sync_done(self, arg) -> None:
        k, v = arg
        self.syncing = False
        self.fleet_version = v
        self.sim.log("global_sync", version=v)
        self._start_gen(k)
        self.try_train()

    # ---------------------------------------------------------------- learner
    def try_train(self) -> None:
        sim = self.sim
        if not self.learner_free():
            return
        k = sim.version
        if k > self.k_gen:
            return
        if self.stream:
            self._train_minibatch(k)
            return
        if k > self.generated_k:
            return
        recs = sim.buffer.take_tagged(k, sim.B // sim.gs)
        if recs is None:
            return
        q = self.group_ids(recs)
        dur = self.update_time(q)
        if self.colocated:
            dur += sim.cfg.cluster.colocate_switch_s
        sim.start_train(q, dur)
        self.taken()

    def _train_minibatch(self, k: int) -> None:
        """stream: the next mini-batch of batch k, once enough of its groups are done."""
        sim = self.sim
        mb = sim.cfg.run.mini_batch
        start = self.mb_next * mb
        if mb % sim.gs:
            raise ValueError(f"run.mini_batch {mb} is not a multiple of workload.group_size "
                             f"{sim.gs}: stream trains whole groups")
        recs = sim.buffer.take_tagged(k, mb // sim.gs)
        if recs is None:
            return
        final = start + mb >= sim.B
        ids = self.group_ids(recs)
        dur = models.minibatch_time(sim.trajectory_tokens(ids), accelerators=sim.cell.train,
                                    model=sim.tm)
        if final:
            dur += sim.tm.step_overhead_s
            self.mb_next = 0
        else:
            self.mb_next += 1
        sim.start_train(ids, dur, final=final)
        self.taken()

    def on_train_done(self, final):
        self.try_train()
        self._try_gen()

    # ---------------------------------------------------------------- failures
    def on_fail(self, dead, orphans, sleeping):
        sim = self.sim
        for r in dead:
            self.active.discard(r.idx)
        ids = sim.restart_orphans(orphans + sleeping)
        if ids and self.generating and self.alive_rollouts():
            self._dispatch(ids)
        elif ids:
            sim.requeued.extend(ids)
        if self.generating and not self.active:
            self._batch_generated()

    def on_recover(self, back):
        self.reset_recovered(back, version=self.fleet_version, phase="wait")
