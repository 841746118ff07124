"""Discrete-event core: clock, rollouts, learner, relay tier, failures and statistics.

A `Sim` simulates one cell (one system on one placement). Scheduling decisions belong to the
mode's policy (`laminar_jax.sim.policies`), which calls back into the core; the core owns the
mechanics every mode shares: decode (via `Rollout`), tool calls, group completion, learner
updates, the relay chain (`laminar_jax.weights.chain`), failures and the statistics a run
reports. Deterministic for a given seed: ties in time are broken by insertion order.
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np

from laminar_jax.manager import modes
from laminar_jax.sim import models
from laminar_jax.sim.buffer import SimBuffer
from laminar_jax.sim.config import CellSpec, SimConfig
from laminar_jax.sim.rollout import Rollout, TrajStore
from laminar_jax.sim.stats import interval_stats, percentile_sorted, steady_state, summarise
from laminar_jax.weights import chain

__all__ = ["Sim", "CapReached"]


class CapReached(RuntimeError):
    """A simulated cell stopped at a cap (run.max_trajectories, run.max_time_s) or ran out of
    events before its learner made the requested updates: its throughput would be meaningless,
    so this is an error naming the cap and the cell instead of a NaN."""


_GROUP_CHUNK = 256


class Sim:
    """One simulated run of `cfg.system(cell.system)` on the placement of `cell`."""

    def __init__(self, cfg: SimConfig, cell: CellSpec):
        self.cfg = cfg
        self.cell = cell
        self.system = cfg.system(cell.system)
        self.mode = self.system.mode
        self.B = cfg.run.global_batch
        self.gs = cfg.workload.group_size
        if self.B % self.gs:
            raise ValueError(f"run.global_batch {self.B} is not a multiple of "
                             f"workload.group_size {self.gs}")
        if self.system.max_concurrency < self.gs:
            raise ValueError(f"systems[{self.system.name}].max_concurrency "
                             f"{self.system.max_concurrency} is below one group ({self.gs})")
        self.wm = cfg.model.weights
        self.tm = self.system.trainer or cfg.model.trainer
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self._on_rollout = self._rollout_event     # one bound method, not one per event
        self.stopped = False

        # workload: common random numbers across systems (same seed -> same trajectories)
        seed = np.random.SeedSequence(cfg.seed)
        s_len, s_tool = seed.spawn(2)
        self._rng_len = np.random.default_rng(s_len)
        self._rng_tool = np.random.default_rng(s_tool)
        self.ts = TrajStore()
        self._next_group = 0
        self.requeued: deque = deque()      # restarted trajectories, served before new groups
        # tool calls: sandbox slots in use and calls queued for one (ToolSpec.sandbox_slots)
        self._sandbox_slots = cfg.workload.tools.sandbox_slots
        self._sandbox_busy = 0
        self._sandbox_queue: deque = deque()   # (trajectory, epoch, latency, queued at)
        self.group_left: list[int] = []

        # rollouts, placed tp-aligned on machines
        tp = self.system.rollout_tp
        apm = cfg.cluster.accelerators_per_machine
        self.decode = models.DecodeModel(cfg.model.profile(tp), self.system.max_num_seqs,
                                         overhead=cfg.model.decode_overhead,
                                         step_overhead_s=cfg.model.decode_step_overhead_s)
        self.rollouts = [
            Rollout(i, (i * tp) // apm, tp, self.decode, self.ts,
                    max_num_seqs=self.system.max_num_seqs, reserve=cfg.cluster.kv_reserve_tokens)
            for i in range(cell.rollout // tp)
        ]
        self.machines = sorted({r.machine for r in self.rollouts})
        self.by_machine: dict[int, list[Rollout]] = {}
        for r in self.rollouts:
            self.by_machine.setdefault(r.machine, []).append(r)

        # relay tier: one relay per rollout machine, master first [P §4]
        self.chain = chain.chain_order(self.machines, self.machines[0])
        self._chain_pos = {m: j for j, m in enumerate(self.chain)}
        self._arrival_cache: dict = {}
        self.relay_join = {m: 0.0 for m in self.machines}
        self.publishes: list[tuple[int, float]] = []   # (version, time the master holds it)
        self.sync_time = models.global_sync_time(self.wm, cell.rollout)
        self.pull_time = models.pull_time(self.wm, tp)
        self.weight_waits: list[float] = []            # request -> loaded, per pull (Fig 14)

        # learner
        self.version = 0
        self.learner_busy = False
        self.learner_blocked_until = 0.0
        self.learner_busy_int = 0.0
        self._learner_t0 = 0.0
        self.buffer = SimBuffer(cfg.buffer_capacity(), cfg.data.buffer_when_full,
                                group_size=self.gs)
        # consumed trajectories: id, learner version, time (parallel lists; `consumed` zips them)
        self.consumed_ids: list[int] = []
        self.consumed_versions: list[int] = []
        self.consumed_times: list[float] = []
        self._step_tokens = 0
        self._step_trajs: list[int] = []

        # statistics
        self.steps: list[dict] = []
        self.events: list[dict] = []
        self.kv_samples: list[dict] = []
        self._sample_prev = (0.0, 0)
        self.gen_role_int = 0.0          # colocated: time in generation phases
        self._gen_role_since: float | None = 0.0
        self.alive_int = 0.0             # rollout-seconds alive
        self._alive_t = 0.0
        self._alive_n = len(self.rollouts)
        self._snap = self._snapshot()

        from laminar_jax.sim import policies
        self.policy = policies.make_policy(self)
        self._refills = modes.refills_continuously(self.mode)

    # ------------------------------------------------------------------ event queue
    def push(self, t: float, fn, arg=None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

    def log(self, kind: str, **fields) -> None:
        self.events.append({"kind": kind, "time": self.now, **fields})

    def run(self) -> "Sim":
        run = self.cfg.run
        target = run.warmup_steps + run.measure_steps
        for f in self.cfg.failures:
            self.push(f.time_s, self._fail, f)
        if run.write != "summary":     # KV samples are only written by run.write=full
            self.push(0.0, self._sample)
        self.policy.start()
        heap = self._heap
        pop = heapq.heappop
        gs = self.gs
        max_t, max_n = run.max_time_s, run.max_trajectories
        while heap and not self.stopped:
            t, _, fn, arg = pop(heap)
            self.now = t
            fn(arg)
            if len(self.steps) >= target:
                return self
            if t > max_t:
                self._cap("run.max_time_s", f"{max_t:g} s of simulated time")
            if self._next_group * gs > max_n:
                self._cap("run.max_trajectories", f"{max_n:,} trajectories issued to rollouts")
        if len(self.steps) < target:
            self._cap("the event queue", "no event left (the modes' rules deadlocked)")
        return self

    def _cap(self, cap: str, what: str) -> None:
        self.log("stopped", reason=cap)
        c = self.cell
        raise CapReached(
            f"cell {c.system}@{c.accelerators} ({self.mode}, train {c.train} / rollout "
            f"{c.rollout}): stopped at {cap} ({what}) after {len(self.steps)} of "
            f"{self.cfg.run.warmup_steps + self.cfg.run.measure_steps} learner updates, "
            f"t = {self.now:,.0f} s; raise {cap} or shorten the run")

    # ------------------------------------------------------------------ workload
    def _new_groups(self, count: int) -> None:
        wl = self.cfg.workload
        prompts = models.sample_lengths(wl.prompt, self._rng_len, count, self.gs)
        resp = models.sample_lengths(wl.response, self._rng_len, count, self.gs)
        tools = models.sample_tools(wl.tools, self._rng_tool, resp)
        # one prompt per group (its first sample's length), all groups in one call
        self.ts.add_groups(np.repeat(prompts[::self.gs], self.gs), resp, tools, self.gs)
        self.group_left.extend([self.gs] * count)

    @property
    def issued(self) -> int:
        """Trajectories handed to rollouts so far (fresh groups x group size)."""
        return self._next_group * self.gs

    def take_groups(self, count: int) -> list[int]:
        """The next `count` fresh prompt groups' trajectory ids (group-major)."""
        first = self._next_group
        need = first + count - len(self.ts.group_members)
        if need > 0:
            self._new_groups(max(need, _GROUP_CHUNK))
        self._next_group += count
        out = []
        for g in range(first, first + count):
            out.extend(self.ts.group_members[g])
        return out

    def take_trajectories(self, limit: int) -> list[int]:
        """Requeued trajectories first, then whole fresh groups, at most `limit` in all."""
        out = []
        while self.requeued and len(out) < limit:
            out.append(self.requeued.popleft())
        groups = (limit - len(out)) // self.gs
        if groups > 0:
            out.extend(self.take_groups(groups))
        return out

    # ------------------------------------------------------------------ rollouts
    def reschedule(self, r: Rollout) -> None:
        r.epoch += 1
        t = r.schedule()
        if t is not None:     # push(), inlined: one rollout event per segment end
            self._seq += 1
            heapq.heappush(self._heap, (t, self._seq, self._on_rollout, (r, r.epoch)))

    def assign(self, r: Rollout, ids, *, front: bool = False) -> None:
        """Queue trajectories on rollout r and admit what fits."""
        r.advance(self.now)
        ts = self.ts
        for i in ids:
            ts.where[i] = r.idx
        if front:
            r.waiting.extendleft(reversed(list(ids)))
        else:
            r.waiting.extend(ids)
        self.admit(r)
        self.reschedule(r)

    def admit(self, r: Rollout) -> None:
        if r.waiting:
            r.admit(self.now)

    def drained(self, r: Rollout) -> bool:
        return r.n == 0 and not r.waiting and not r.sleeping and r.incoming == 0

    def _rollout_event(self, arg) -> None:
        r, epoch = arg
        if epoch != r.epoch or not r.alive:
            return
        now = self.now
        due = r.on_event(now)
        if due:
            ts = self.ts
            tools, finish, where, group, left = ts.tools, ts.finish_t, ts.where, ts.group, \
                self.group_left
            for i in due:
                if tools[i] is not None:
                    self._segment_done(r, i)
                    continue
                # _complete(i), inlined: the common case (no tool call) of every segment end
                finish[i] = now
                r_idx = where[i]
                where[i] = -1
                g = group[i]
                left[g] -= 1
                if not left[g]:
                    self.policy.on_group_done(g, r_idx)
        r.preempt_overflow()
        if self._refills:
            self.policy.refill(r)
        if r.waiting:
            r.admit(now)
        r.epoch += 1                   # reschedule(r), inlined
        t = r.schedule()
        if t is not None:
            self._seq += 1
            heapq.heappush(self._heap, (t, self._seq, self._on_rollout, (r, r.epoch)))
        if not r.n and not r.waiting and not r.sleeping and not r.incoming:   # drained(r)
            r.heap.clear()
            r.order.clear()
            self.policy.on_drained(r)

    def _segment_done(self, r: Rollout, i: int) -> None:
        ts = self.ts
        t = ts.tools[i]
        k = ts.seg[i]
        if t is None or k >= len(t[0]):
            self._complete(i)
            return
        # tool call: KV freed; the output is appended and re-prefilled on return
        ts.seg[i] = k + 1
        ts.seg_end[i] = t[0][k + 1] if k + 1 < len(t[0]) else ts.resp[i]
        ts.obs_done[i] += t[2]
        r.sleeping.add(i)
        self._call_tool(i, ts.epoch[i], t[1][k])

    def _call_tool(self, i: int, epoch: int, latency: float) -> None:
        """Run a call now, or queue it while every sandbox slot is busy."""
        if self._sandbox_slots and self._sandbox_busy >= self._sandbox_slots:
            self._sandbox_queue.append((i, epoch, latency, self.now))
            return
        self._sandbox_busy += 1
        self.push(self.now + latency, self._tool_return, (i, epoch))

    def _tool_return(self, arg) -> None:
        i, epoch = arg
        ts = self.ts
        self._sandbox_busy -= 1   # the slot frees whatever became of the trajectory meanwhile
        while self._sandbox_queue and (not self._sandbox_slots or self._sandbox_busy < self._sandbox_slots):
            j, e, latency, queued = self._sandbox_queue.popleft()
            if ts.epoch[j] != e or ts.where[j] < 0:
                continue   # restarted or gone while it queued: the call never runs
            ts.tool_wait[j] += self.now - queued
            self._call_tool(j, e, latency)
        if ts.epoch[i] != epoch or ts.where[i] < 0:
            return
        r = self.rollouts[ts.where[i]]
        if i not in r.sleeping or not r.alive:
            return
        r.sleeping.discard(i)
        self.assign(r, [i])

    def _complete(self, i: int) -> None:
        ts = self.ts
        ts.finish_t[i] = self.now
        r_idx = ts.where[i]
        ts.where[i] = -1
        g = ts.group[i]
        self.group_left[g] -= 1
        if self.group_left[g] == 0:
            self.policy.on_group_done(g, r_idx)

    # ------------------------------------------------------------------ relays / weights
    def chain_position(self, machine: int) -> int:
        """Position of `machine`'s relay in the broadcast chain (0 = master)."""
        return self._chain_pos[machine]

    def _relay_arrival(self, r: Rollout) -> float | None:
        pos = self._chain_pos.get(r.machine)
        if pos is None:
            return None
        key = (pos, len(self.chain))
        arr = self._arrival_cache.get(key)
        if arr is None:
            arr = models.relay_arrival(self.wm, pos, len(self.chain))
            self._arrival_cache[key] = arr
        return arr

    def relay_version(self, r: Rollout) -> int:
        """Newest version complete at r's local relay now (chain time model, App. D)."""
        arr = self._relay_arrival(r)
        if arr is None:
            return r.version
        join = self.relay_join[r.machine]
        for v, t in reversed(self.publishes):
            if max(t, join) + arr <= self.now:
                return v
        return 0

    def newest_version(self, r: Rollout) -> tuple[int, float]:
        """(newest version the master relay holds now, when it is complete at r's relay).

        A rollout asking for weights gets this version, waiting for it while it still travels
        down the chain [P §4, Fig 14: the mean wait exceeds the relay-to-GPU load]."""
        arr = self._relay_arrival(r)
        if arr is None:
            return r.version, self.now
        join = self.relay_join[r.machine]
        for v, t in reversed(self.publishes):
            if t <= self.now:
                return v, max(t, join) + arr
        return 0, self.now

    # ------------------------------------------------------------------ learner
    def start_train(self, ids: list[int], duration: float, *, final: bool = True) -> None:
        """The learner consumes `ids` (one mini-batch or a whole global batch) now."""
        self.learner_busy = True
        self._learner_t0 = self.now
        v = self.version
        n = len(ids)
        self.consumed_ids.extend(ids)
        self.consumed_versions.extend([v] * n)
        self.consumed_times.extend([self.now] * n)
        self._step_trajs.extend(zip(ids, [v] * n))
        self.push(self.now + duration, self._train_done, final)

    @property
    def consumed(self) -> list[tuple[int, int, float]]:
        """(trajectory id, learner version, time) of every consumed trajectory, in order."""
        return list(zip(self.consumed_ids, self.consumed_versions, self.consumed_times))

    def _train_done(self, final: bool) -> None:
        self.learner_busy = False
        self.learner_busy_int += self.now - self._learner_t0
        if final:
            self.version += 1
            self._record_step()
        self.policy.on_train_done(final)

    def block_learner(self, seconds: float) -> None:
        """The learner stalls (publish / global sync) for `seconds` from now."""
        self.learner_blocked_until = max(self.learner_blocked_until, self.now + seconds)

    def learner_ready(self) -> bool:
        return not self.learner_busy and self.now >= self.learner_blocked_until

    def trajectory_tokens(self, ids) -> np.ndarray:
        """Prompt + response (+ tool output) tokens of `ids` (float64, in order)."""
        return self.ts.totals()[np.fromiter(ids, np.int64, count=len(ids))]

    # ------------------------------------------------------------------ statistics
    def set_gen_role(self, on: bool) -> None:
        """Colocated placements: mark the start / end of a generation phase."""
        if on and self._gen_role_since is None:
            self._gen_role_since = self.now
        elif not on and self._gen_role_since is not None:
            self.gen_role_int += self.now - self._gen_role_since
            self._gen_role_since = None

    def _alive_update(self) -> None:
        self.alive_int += self._alive_n * (self.now - self._alive_t)
        self._alive_t = self.now
        self._alive_n = sum(1 for r in self.rollouts if r.alive)

    def _snapshot(self) -> dict:
        for r in self.rollouts:
            r.advance(self.now)
        self._alive_update()
        gen_role = self.gen_role_int + (self.now - self._gen_role_since
                                        if self._gen_role_since is not None else 0.0)
        learner = self.learner_busy_int + (self.now - self._learner_t0 if self.learner_busy
                                           else 0.0)
        return {
            "time": self.now,
            "busy": sum(r.busy_int - r.load_int for r in self.rollouts),
            "kv": sum(r.kv_int / r.cap for r in self.rollouts),
            "gen_tokens": sum(r.gen_tokens for r in self.rollouts),
            "alive": self.alive_int,
            "gen_role": gen_role,
            "learner": learner,
        }

    def interval_stats(self, a: dict, b: dict) -> dict:
        """Idle fractions, KV use and generation rate between two snapshots (`stats.interval_stats`)."""
        return interval_stats(a, b, colocated=self.system.colocated, rollout_tp=self.system.rollout_tp,
                              accelerators=self.cell.accelerators, train_accelerators=self.cell.train,
                              num_rollouts=len(self.rollouts))

    def _record_step(self) -> None:
        pairs = self._step_trajs
        self._step_trajs = []
        ids = [i for i, _ in pairs]
        tokens = int(self.trajectory_tokens(ids).sum())
        prev_t = self.steps[-1]["time"] if self.steps else 0.0
        snap = self._snapshot()
        stats = self.interval_stats(self._snap, snap)
        self._snap = snap
        gv = self.ts.gen_version
        stale = np.fromiter((v - gv[i] for i, v in pairs), dtype=np.int64, count=len(pairs))
        if stale.size and stale.min() < 0:       # modes.staleness raises, naming the bug
            i, v = pairs[int(np.argmin(stale))]
            modes.staleness(v, gv[i])
        dt = self.now - prev_t
        self.steps.append({
            "step": len(self.steps) + 1,
            "time": self.now,
            "version": self.version,
            "trajectories": len(ids),
            "tokens": tokens,
            "iteration_s": dt,
            "throughput": tokens / dt if dt > 0 else float("nan"),
            "staleness_mean": float(stale.mean()) if stale.size else float("nan"),
            "staleness_max": int(stale.max()) if stale.size else 0,
            "buffer_groups": len(self.buffer),
            "held_groups": len(self.buffer.held),
            **stats,
        })
        self.log("publish", version=self.version)

    def _sample(self, _=None) -> None:
        for r in self.rollouts:
            r.advance(self.now)
        gen = sum(r.gen_tokens for r in self.rollouts)
        prev_t, prev_gen = self._sample_prev
        self._sample_prev = (self.now, gen)
        alive = [r for r in self.rollouts if r.alive]
        if alive:
            use = sorted([r.kv() / r.cap for r in alive])
            self.kv_samples.append({
                "time": self.now,
                "gen_tokens_per_s": (gen - prev_gen) / (self.now - prev_t)
                if self.now > prev_t else 0.0,
                "kv_use_mean": sum(use) / len(use),
                "kv_use_p10": percentile_sorted(use, 10.0),
                "kv_use_p90": percentile_sorted(use, 90.0),
                "running": int(sum(r.n for r in alive)),
                "waiting": int(sum(len(r.waiting) for r in alive)),
                "alive_rollouts": len(alive),
                "learner_version": self.version,
            })
        self.push(self.now + self.cfg.run.sample_interval_s, self._sample)

    # ------------------------------------------------------------------ failures
    def _fail(self, spec) -> None:
        machine = self.machines[spec.machine % len(self.machines)]
        dead = [r for r in self.by_machine[machine] if r.alive]
        if not dead:
            return
        orphans, sleeping = [], []
        for r in dead:
            r.advance(self.now)
            orphans.extend(r.extract())
            sleeping.extend(r.sleeping)
            r.sleeping = set()
            r.incoming = 0
            r.alive = False
            r.phase = "dead"
            self.reschedule(r)
        self._alive_update()
        if machine in self._chain_pos:
            self.chain = chain.relink(self.chain, machine)
            self._chain_pos = {m: j for j, m in enumerate(self.chain)}
        self.log("failure", machine=machine, rollouts=[r.idx for r in dead],
                 trajectories=len(orphans) + len(sleeping))
        self.policy.on_fail(dead, orphans, sleeping)
        self.push(self.now + spec.recovery_s, self._recover, machine)

    def _recover(self, machine: int) -> None:
        back = self.by_machine[machine]
        for r in back:
            r.alive = True
            r.phase = "idle"
            r.version = 0
            r.S = 0
            r.t_ref = self.now
            r.t_stat = self.now
            r.n = r.sum_base = r.sum_admit = 0
            r.heap.clear()
            r.order.clear()
            r.waiting.clear()
            r.resident.clear()
        self._alive_update()
        self.chain = self.chain + (machine,)
        self._chain_pos = {m: j for j, m in enumerate(self.chain)}
        self.relay_join[machine] = self.now
        self.log("recovery", machine=machine, rollouts=[r.idx for r in back])
        self.policy.on_recover(back)

    def restart_orphans(self, ids) -> list[int]:
        """Trajectories whose progress is lost: restarted from their prompt."""
        for i in ids:
            self.ts.restart(i)
            self.ts.where[i] = -1
        return list(ids)

    def steady_state(self) -> dict:
        """Whether the measured updates are a steady state (`stats.steady_state`)."""
        return steady_state(self.steps, warmup_steps=self.cfg.run.warmup_steps, capacity=self.buffer.capacity)

    def summary(self) -> dict:
        """Throughput and idle over the measured steps (after warm-up) [P §8 metric]."""
        out = summarise(self.steps, warmup_steps=self.cfg.run.warmup_steps)
        if "measured_steps" not in out:
            return out
        out["evicted_groups"] = len(self.buffer.evicted)
        out["dropped_stale_groups"] = len(self.buffer.dropped_stale)
        out["weight_wait_s"] = (float(np.mean(self.weight_waits)) if self.weight_waits
                                else float("nan"))
        out.update(self.steady_state())
        return out
