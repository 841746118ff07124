"""Scheduling policies of the five modes, driving the simulator core.

The rules come from the runtime's pure functions, not copies: staleness bounds and admission
from `laminar_jax.manager.modes`, the repack plan from `laminar_jax.manager.repack.plan`, relay
arrival from `laminar_jax.weights.chain` (through `Sim.relay_version`).

- GlobalBatch (sync, one_step, stream): the fleet generates global batch k on the newest
  version v with `may_start_batch(k, v, bound)`, split evenly over the rollouts; a new version
  reaches the rollouts by a global sync (every rollout and, without a weight buffer, the learner
  stall). sync may be colocated (learner and rollouts time-share all accelerators). stream
  trains mini-batches as the batch's groups complete (FIFO) and keeps a weight copy, so its
  learner is not stalled by the sync.
- Partial (AReaL): rollouts refill continuously up to max_concurrency, gated by `may_submit`;
  every publish interrupts all rollouts, which load the weights (global sync) and re-prefill
  their running trajectories; trajectories span versions.
- Laminar: each rollout takes a batch of max_concurrency, drains it on one version, then pulls
  the newest version its local relay holds; the learner stalls only for the publish. With
  repack, the manager runs `plan` every interval and after each publish and moves trajectories
  between rollouts of one version. Without relays a publish waits for a global sync barrier.
"""

from __future__ import annotations

import heapq

import numpy as np

from laminar_jax.manager import modes
from laminar_jax.manager.repack import RolloutLoad, plan
from laminar_jax.sim import models

__all__ = ["make_policy", "GlobalBatch", "Partial", "Laminar"]


class Policy:
    def __init__(self, sim):
        self.sim = sim
        self.system = sim.system
        self._wake_pending = False

    def start(self): raise NotImplementedError
    def on_drained(self, r): pass
    def on_group_done(self, g): raise NotImplementedError
    def on_train_done(self, final: bool): raise NotImplementedError
    def refill(self, r): pass
    def on_fail(self, dead, orphans, sleeping): raise NotImplementedError
    def on_recover(self, back): raise NotImplementedError

    def _wake_learner_later(self) -> None:
        """The learner is blocked (publish / sync): retry training when it is free."""
        sim = self.sim
        if self._wake_pending or sim.learner_blocked_until == float("inf"):
            return
        self._wake_pending = True

        def wake(_):
            self._wake_pending = False
            self.try_train()

        sim.push(sim.learner_blocked_until, wake)

    def try_train(self): raise NotImplementedError

    def _train_fifo(self) -> None:
        """Consume one global batch FIFO from the experience buffer when it holds one."""
        sim = self.sim
        if sim.learner_busy:
            return
        if sim.now < sim.learner_blocked_until:
            self._wake_learner_later()
            return
        if len(sim.buffer) < sim.B:
            return
        ids = [sim.buffer.popleft() for _ in range(sim.B)]
        dur = models.train_time(sim.trajectory_tokens(ids), accelerators=sim.cell.train,
                                model=sim.tm, mini_batch=sim.cfg.run.mini_batch)
        sim.start_train(ids, dur)

    def _to_buffer(self, g) -> None:
        self.sim.buffer.extend(self.sim.ts.group_members[g])


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
        self.ready: dict[int, list[int]] = {}
        self.generated_k = -1
        self.batch_of: dict[int, int] = {}
        self.mb_next = 0

    def start(self):
        self._start_gen(0)

    def _start_gen(self, k: int) -> None:
        sim = self.sim
        ts = sim.ts
        ids = sim.take_trajectories(sim.B)
        for i in ids[:: sim.gs]:
            self.batch_of[ts.group[i]] = k
        self.ready[k] = []
        alive = [r for r in sim.rollouts if r.alive]
        self.k_gen = k
        self.generating = True
        self.active = set()
        if self.colocated:
            sim.set_gen_role(True)
        for r, chunk in zip(alive, np.array_split(np.asarray(ids, dtype=np.int64), len(alive))):
            r.version = self.fleet_version
            if len(chunk):
                r.phase = "run"
                self.active.add(r.idx)
                sim.assign(r, chunk.tolist())
        sim.log("batch_start", batch=k, version=self.fleet_version)

    def on_drained(self, r):
        if r.idx in self.active:
            self.active.discard(r.idx)
            r.phase = "wait"
            if not self.active:
                self._batch_generated()

    def _batch_generated(self) -> None:
        sim = self.sim
        self.generating = False
        self.generated_k = self.k_gen
        if self.colocated:
            sim.set_gen_role(False)
        # a global sync first: without a weight buffer the learner takes part in it
        self._try_gen()
        self.try_train()

    def on_group_done(self, g):
        k = self.batch_of.pop(g)
        self.ready[k].extend(self.sim.ts.group_members[g])
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
        if v > self.fleet_version:
            self.syncing = True
            t = sim.sync_time + (sim.cfg.cluster.colocate_switch_s if self.colocated else 0.0)
            if not self.stream:          # no weight buffer: the learner takes part in the sync
                sim.block_learner(t)
            for r in sim.rollouts:
                if r.alive:
                    r.phase = "sync"
            sim.push(sim.now + t, self._sync_done, (k, v))
        else:
            self._start_gen(k)

    def _sync_done(self, arg) -> None:
        k, v = arg
        self.syncing = False
        self.fleet_version = v
        self.sim.log("global_sync", version=v)
        self._start_gen(k)
        self.try_train()

    def try_train(self) -> None:
        sim = self.sim
        if sim.learner_busy:
            return
        if sim.now < sim.learner_blocked_until:
            self._wake_learner_later()
            return
        k = sim.version
        q = self.ready.get(k)
        if q is None:
            return
        mb = sim.cfg.run.mini_batch
        if self.stream:
            start = self.mb_next * mb
            if len(q) < start + mb:
                return
            final = start + mb >= sim.B
            ids = q[start:start + mb]
            dur = models.minibatch_time(sim.trajectory_tokens(ids),
                                        accelerators=sim.cell.train, model=sim.tm)
            if final:
                dur += sim.tm.step_overhead_s
                self.mb_next = 0
                del self.ready[k]
            else:
                self.mb_next += 1
            sim.start_train(ids, dur, final=final)
            return
        if k > self.generated_k or len(q) < sim.B:
            return
        dur = models.train_time(sim.trajectory_tokens(q), accelerators=sim.cell.train,
                                model=sim.tm, mini_batch=mb)
        if self.colocated:
            dur += sim.cfg.cluster.colocate_switch_s
        del self.ready[k]
        sim.start_train(q, dur)

    def on_train_done(self, final):
        self.try_train()
        self._try_gen()

    def on_fail(self, dead, orphans, sleeping):
        sim = self.sim
        for r in dead:
            self.active.discard(r.idx)
        ids = sim.restart_orphans(orphans + sleeping)
        alive = [r for r in sim.rollouts if r.alive]
        if ids and alive and self.generating:
            for r, chunk in zip(alive, np.array_split(np.asarray(ids), len(alive))):
                if len(chunk):
                    r.phase = "run"
                    self.active.add(r.idx)
                    sim.assign(r, chunk.tolist())
        elif ids:
            sim.requeued.extend(ids)
        if self.generating and not self.active:
            self._batch_generated()

    def on_recover(self, back):
        for r in back:
            r.version = self.fleet_version
            r.phase = "wait"


class Partial(Policy):
    """AReaL-style partial rollout with interruptible generation.

    Its sampler gives older trajectories priority (AReaL): complete groups are consumed by the
    version they started on, then by completion order.
    """

    def __init__(self, sim):
        super().__init__(sim)
        self.eta = modes.staleness_bound("partial", max_staleness=self.system.max_staleness)
        self.submitted = 0
        self._ready: list = []          # heap of (oldest gen_version, completion seq, group)
        self._ready_trajs = 0
        self._done_seq = 0

    def start(self):
        for r in self.sim.rollouts:
            r.phase = "run"
            self.refill(r)
            self.sim.admit(r)
            self.sim.reschedule(r)

    def refill(self, r):
        sim = self.sim
        if not r.alive or r.phase != "run":
            return
        room = self.system.max_concurrency - r.unfinished()
        ts = sim.ts
        while room >= sim.gs and modes.may_submit(self.submitted, sim.version,
                                                  batch_size=sim.B, eta=self.eta):
            ids = sim.take_trajectories(sim.gs)
            for i in ids:
                ts.where[i] = r.idx
            r.waiting.extend(ids)
            self.submitted += len(ids)
            room -= len(ids)

    def on_group_done(self, g):
        ts = self.sim.ts
        members = ts.group_members[g]
        self._done_seq += 1
        heapq.heappush(self._ready, (min(ts.gen_version[i] for i in members), self._done_seq, g))
        self._ready_trajs += len(members)
        self.try_train()

    def try_train(self):
        sim = self.sim
        if sim.learner_busy:
            return
        if sim.now < sim.learner_blocked_until:
            self._wake_learner_later()
            return
        if self._ready_trajs < sim.B:
            return
        ids: list[int] = []
        while len(ids) < sim.B:
            _, _, g = heapq.heappop(self._ready)
            ids.extend(sim.ts.group_members[g])
        self._ready_trajs -= len(ids)
        dur = models.train_time(sim.trajectory_tokens(ids), accelerators=sim.cell.train,
                                model=sim.tm, mini_batch=sim.cfg.run.mini_batch)
        sim.start_train(ids, dur)

    def on_train_done(self, final):
        sim = self.sim
        if self.system.weight_transfer == "storage":
            # the learner writes the version; rollouts keep generating on the old one meanwhile
            write = sim.wm.bytes / sim.wm.storage_write_bytes_per_s
            sim.block_learner(write)
            sim.push(sim.now + write, self._interrupt, sim.wm.bytes / sim.wm.storage_read_bytes_per_s)
        else:
            sim.block_learner(sim.sync_time)
            self._interrupt(sim.sync_time)

    def _interrupt(self, load_s: float) -> None:
        """Every rollout stops, loads the newest version (load_s) and re-prefills its work."""
        sim = self.sim
        ts = sim.ts
        for r in sim.rollouts:
            if not r.alive:
                continue
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
            self.refill(r)
            sim.admit(r)
            sim.reschedule(r)
        sim.log("interrupt", version=sim.version)
        self.try_train()

    def on_fail(self, dead, orphans, sleeping):
        sim = self.sim
        sim.requeued.extend(sim.restart_orphans(orphans + sleeping))
        for r in sim.rollouts:
            if r.alive and r.phase == "run":
                self.refill(r)
                sim.assign(r, [])

    def on_recover(self, back):
        sim = self.sim
        for r in back:
            r.version = sim.version
            r.phase = "run"
            r.t_ref = sim.now + sim.pull_time
            self.refill(r)
            sim.assign(r, [])


class Laminar(Policy):
    """Trajectory-level asynchrony with relays and repack [P §3-§5]."""

    def __init__(self, sim):
        super().__init__(sim)
        self.relays = self.system.relays
        self.repack = modes.repacks(sim.mode, enabled=self.system.repack)
        self.pending: int | None = None     # relays off: version waiting for the barrier
        self.barrier = False
        self.rp = sim.cfg.repack

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
        v = sim.relay_version(r) if self.relays else r.version
        if v > r.version:
            r.phase = "pull"
            sim.push(sim.now + sim.pull_time, self._pull_done, (r, v))
        else:
            self._start_batch(r)

    def _pull_done(self, arg) -> None:
        r, v = arg
        if not r.alive or r.phase != "pull":
            return
        r.version = v
        self.sim.log("pull", rollout=r.idx, version=v)
        self._start_batch(r)

    def _start_batch(self, r) -> None:
        sim = self.sim
        r.phase = "run"
        sim.assign(r, sim.take_trajectories(self.system.max_concurrency))

    def on_drained(self, r):
        if r.phase == "run":
            self.next_batch(r)

    # ---------------------------------------------------------------- learner
    def on_group_done(self, g):
        self._to_buffer(g)
        self.try_train()

    def try_train(self):
        self._train_fifo()

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
        if self.repack:
            self._repack()

    def _check_barrier(self) -> None:
        sim = self.sim
        if self.pending is None or self.barrier:
            return
        if all(r.phase == "wait" for r in sim.rollouts if r.alive):
            self.barrier = True
            sim.push(sim.now + sim.sync_time, self._barrier_done)

    def _barrier_done(self, _=None) -> None:
        sim = self.sim
        v, self.pending, self.barrier = self.pending, None, False
        sim.learner_blocked_until = sim.now
        sim.log("global_sync", version=v)
        for r in sim.rollouts:
            if r.alive:
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
        for r in sim.rollouts:
            if not r.alive or r.phase != "run" or r.incoming:
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
        sim = self.sim
        ts = sim.ts
        ids = src.extract()
        for i in src.sleeping:
            ts.where[i] = dst.idx
            ts.repacks[i] += 1
        dst.sleeping |= src.sleeping
        src.sleeping = set()
        sim.reschedule(src)
        for i in ids:
            ts.repacks[i] += 1
        if ids:
            dst.incoming += len(ids)
            sim.push(sim.now + self.rp.overhead_s, self._arrive, (dst, ids))

    def _arrive(self, arg) -> None:
        dst, ids = arg
        sim = self.sim
        dst.incoming -= len(ids)
        if not dst.alive:
            sim.requeued.extend(sim.restart_orphans(ids))
            return
        sim.assign(dst, ids)
        if sim.drained(dst):
            self.on_drained(dst)

    # ---------------------------------------------------------------- failures [P §7]
    def on_fail(self, dead, orphans, sleeping):
        sim = self.sim
        ts = sim.ts
        by_version: dict[int, list[int]] = {}
        fresh = []
        for i in orphans + sleeping:
            v = ts.gen_version[i]
            (by_version.setdefault(v, []) if v >= 0 else fresh).append(i)
        sleeping_set = set(sleeping)
        for v, ids in by_version.items():
            targets = [r for r in sim.rollouts if r.alive and r.phase == "run" and r.version == v]
            if not targets:
                sim.requeued.extend(sim.restart_orphans(ids))
                continue
            targets.sort(key=lambda r: (r.kv(), r.idx))
            for r, chunk in zip(targets, np.array_split(np.asarray(ids), len(targets))):
                moving = []
                for i in chunk.tolist():
                    if i in sleeping_set:
                        ts.where[i] = r.idx
                        r.sleeping.add(i)
                    else:
                        moving.append(i)
                if moving:
                    r.incoming += len(moving)
                    sim.push(sim.now + self.rp.overhead_s, self._arrive, (r, moving))
        for i in fresh:
            ts.where[i] = -1
        sim.requeued.extendleft(reversed(fresh))
        if not self.relays:
            self._check_barrier()

    def on_recover(self, back):
        sim = self.sim
        for r in back:
            r.phase = "idle"
            pos = sim._chain_pos[r.machine]
            delay = models.relay_arrival(sim.wm, pos, len(sim.chain))
            sim.push(sim.now + delay, lambda rr: self.next_batch(rr), r)


def make_policy(sim) -> Policy:
    mode = sim.mode
    if modes.uses_global_batches(mode):
        return GlobalBatch(sim)
    if mode == "partial":
        return Partial(sim)
    return Laminar(sim)
