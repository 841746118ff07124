"""RolloutManager: heartbeats, repack and failover of the rollout fleet (paper sections 3, 5, 7).

    every repack_interval_s, and at once after each publish (`kick`):
        stats  <- every rollout (a rollout that errors or reports a failed engine is dead)
        dead   -> its groups: re-issued to a live rollout on the same version when all their
                  samples are in the PartialPool, else re-queued as prompts
        repack -> per version group, `repack.plan` (Algorithm 1); each move: release the
                  source, adopt its trajectories on the destination (same version, so a
                  trajectory never changes version), record the new holder in the ledger

What the plan is given (`plan_loads`, `roofline_batch`), and why:
- C_prev is the highest KV use of the rollout's batch in hand (`kv_peak` of its heartbeat), not
  the previous sample. Ramp-down is a phase of the batch [P §5.2, Fig 9]: once nothing waits,
  KV use only falls as trajectories finish. Sample to sample, a tail of a few trajectories holds
  its KV pages flat (a page covers many tokens) or grows them, so the strict `C_used < C_prev`
  against the last sample held for a draining rollout only in the rounds where one of its
  trajectories had just finished, and two rollouts of a version rarely passed it in the same
  round. A rollout with requests waiting is not ramping down whatever its KV does.
- B is min(manager.roofline_batch, rollout.max_concurrency): a destination cannot run more
  sequences than its engine's concurrency; a plan beyond it leaves moved trajectories waiting.
- Rollouts are planned per engine kind (`rollout.pools`): a trajectory never moves between
  engines with different numerics, and a failed rollout's groups go to one of its own kind.

Liveness (heartbeats): every round asks each rollout for its stats without waiting on one that has
not answered yet; a rollout is dead when its actor is gone, its engine reports a failure, or its
last ask has been unanswered for `manager.heartbeat_timeout_s` -- or, before it ever reported
weights (the first compile holds the worker's lock), for `manager.startup_grace_s`. A round never
blocks longer than `manager.heartbeat_s` on answers.

Restarts: given `spawn(index, restart) -> (rollout_id, handle)`, a dead rollout is replaced by a new
actor under a new id ("rollout-1.r1", so the ledger never confuses its groups with the dead one's)
after its groups were re-issued or re-queued, up to `manager.max_restarts` in the whole run.

The manager holds rollout handles and the data actor; it runs no model. Plain class, wrapped as
a Ray actor by the driver.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import ray

from laminar_jax.manager import modes
from laminar_jax.manager.repack import RolloutLoad, plan
from laminar_jax.runtime.rpc import call, send

CALL_TIMEOUT_S = 60.0   # release / adopt / data-actor calls: a hung peer is an error, not a hang


def roofline_batch(cfg: Any) -> int:
    """B of Algorithm 1: the roofline knee, capped by what one rollout's engine can run at once."""
    return min(cfg.manager.roofline_batch, cfg.rollout.max_concurrency)


def plan_loads(stats: dict[str, dict], kv_prev: dict[str, float]) -> list[RolloutLoad]:
    """The plan's view of the fleet: one `RolloutLoad` per rollout that has weights.

    C_prev is the batch's KV peak (`kv_peak`) when the rollout reports it, else the previous
    sample in `kv_prev`; a rollout with waiting requests gets C_prev = C_used, so it is never a
    ramp-down candidate (module docstring).
    """
    loads = []
    for rid, s in stats.items():
        if s["version"] < 0:
            continue
        used = s["kv_used"]
        prev = s.get("kv_peak", kv_prev.get(rid, used))
        if s.get("num_waiting", 0) > 0:
            prev = used
        loads.append(RolloutLoad(rid, s["version"], used, max(prev, used), s["num_running"]))
    return loads


class RolloutManager:
    def __init__(self, cfg: Any, rollouts: dict[str, Any], data: Any, *, spawn: Any = None,
                 loops: dict[str, Any] | None = None):
        self.cfg, self.data = cfg, data
        self.rollouts = dict(rollouts)
        self.spawn, self.loops = spawn, dict(loops or {})
        self.restarts = 0
        self._index = {rid: i for i, rid in enumerate(self.rollouts)}   # rollout id -> spawn index
        self._asked: dict[str, tuple[Any, float]] = {}   # rid -> (pending stats ref, when asked)
        self._started = {rid: time.time() for rid in self.rollouts}   # until it reports weights
        self.kv_prev: dict[str, float] = {}
        self.last_stats: dict[str, dict] = {}
        self._kick, self._stop = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self._events: list[dict] = []
        self.counters = dict(rounds=0, moves=0, moved_trajectories=0, failed_moves=0, dead=0,
                             reissued_groups=0, requeued_groups=0, restarts=0, errors=0)
        self.repack = modes.repacks(cfg.manager.mode, enabled=cfg.manager.repack)
        # rollout id -> its pool (engine kind); a rollout named otherwise belongs to the first pool
        self.pools = dict(cfg.rollout.assignments())
        self._pool = lambda rid: self.pools.get(rid, cfg.rollout.pools_resolved()[0])

    def run(self) -> None:
        while not self._stop.is_set():
            self._kick.wait(self.cfg.manager.repack_interval_s)
            self._kick.clear()
            if not self._stop.is_set():
                try:
                    self.round()
                except Exception as e:  # noqa: BLE001 - one bad round must not end supervision
                    self.counters["errors"] += 1
                    self._event("manager_error", error=f"{type(e).__name__}: {e}")

    def kick(self) -> None:
        """Called after each publish: repack now so released rollouts get the new weights sooner."""
        self._kick.set()

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()

    # ------------------------------------------------------------------ one round
    def round(self) -> dict[str, dict]:
        stats = self._heartbeat()
        if self.repack:  # per engine kind: a trajectory never moves to another engine's numerics
            by_kind: dict[str, list] = {}
            for load in plan_loads(stats, self.kv_prev):
                by_kind.setdefault(self._pool(load.id).engine, []).append(load)
            for loads in by_kind.values():
                batch = min(self.cfg.manager.roofline_batch, *(self._pool(x.id).max_concurrency for x in loads))
                for move in plan(loads, c_max=self.cfg.manager.c_max, roofline_batch=batch):
                    self._move(move.source, move.destination, move.version)
        self.kv_prev = {rid: s["kv_used"] for rid, s in stats.items()}
        self.counters["rounds"] += 1
        return stats

    def _heartbeat(self) -> dict[str, dict]:
        now, m = time.time(), self.cfg.manager
        stats, dead = {}, []
        for rid, h in self.rollouts.items():   # ask every rollout first: a slow one delays no other
            if not hasattr(h.stats, "remote"):    # an in-process rollout (unit tests)
                try:
                    s = h.stats()
                except Exception as e:  # noqa: BLE001
                    dead.append((rid, type(e).__name__))
                    continue
                stats[rid] = s
            elif rid not in self._asked:
                self._asked[rid] = (h.stats.remote(), now)
        if self._asked:
            ray.wait([ref for ref, _ in self._asked.values()], num_returns=len(self._asked),
                     timeout=m.heartbeat_s)
        now = time.time()
        for rid, (ref, asked) in list(self._asked.items()):
            try:
                stats[rid] = ray.get(ref, timeout=0)
                del self._asked[rid]
            except ray.exceptions.GetTimeoutError:
                starting = rid in self._started
                limit = m.startup_grace_s if starting else m.heartbeat_timeout_s
                if now - asked > limit:
                    del self._asked[rid]
                    dead.append((rid, f"no heartbeat for {now - asked:.0f} s "
                                      f"(manager.{'startup_grace_s' if starting else 'heartbeat_timeout_s'}"
                                      f"={limit:g})"))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                del self._asked[rid]
                dead.append((rid, type(e).__name__))
        for rid in [r for r, s in stats.items() if s["failed"]]:
            dead.append((rid, stats.pop(rid)["failed"]))
        for rid, s in stats.items():
            if s["version"] >= 0:
                self._started.pop(rid, None)
        self.last_stats = stats
        for rid, why in dead:
            self._failover(rid, why, stats)
            self._restart(rid)
        return stats

    def _restart(self, rid: str) -> None:
        if self.spawn is None:
            return
        budget = self.cfg.manager.max_restarts
        if self.restarts >= budget:
            self._event("rollout_not_restarted", rollout=rid, restarts=self.restarts, max_restarts=budget)
            return
        self.restarts += 1
        self.counters["restarts"] += 1
        index = self._index.pop(rid)
        new_id, handle = self.spawn(index, self.restarts)
        self._index[new_id] = index
        self.rollouts[new_id] = handle
        self.loops[new_id] = handle.run.remote()
        self._started[new_id] = time.time()
        print(f"manager: rollout {rid} replaced by {new_id} (restart {self.restarts} of "
              f"manager.max_restarts={budget})", flush=True)
        self._event("rollout_restarted", rollout=new_id, replaces=rid, restarts=self.restarts)

    def _move(self, source: str, destination: str, version: int) -> None:
        t0 = time.time()
        got = call(self.rollouts[source].release, version, timeout=CALL_TIMEOUT_S)
        if got is None:
            return
        groups, partials = got
        moved = [p.moved_to(destination) for p in partials]
        gids = [g.group_id for g in groups]
        try:
            ok, error = call(self.rollouts[destination].adopt, version, groups, moved,
                             timeout=CALL_TIMEOUT_S), None
            overhead_s = time.time() - t0  # the moved trajectories decode nowhere meanwhile
        except Exception as e:  # noqa: BLE001 - a destination that fails must not stop repack
            ok, error = False, f"{type(e).__name__}: {e}"
        if ok:
            call(self.data.reassign, gids, destination, timeout=CALL_TIMEOUT_S)
            send(self.data.update_partials, moved)
            self.counters["moves"] += 1
            self.counters["moved_trajectories"] += len(moved)
            self._event("repack", source=source, destination=destination, version=version,
                        groups=len(groups), trajectories=len(moved),
                        unfinished=sum(p.finish_reason is None for p in moved), group_ids=gids,
                        overhead_s=overhead_s)
        else:  # the destination moved on to newer weights meanwhile: regenerate, never mix versions
            call(self.data.requeue, gids, timeout=CALL_TIMEOUT_S)
            self.counters["failed_moves"] += 1
            self._event("repack_refused", source=source, destination=destination, version=version,
                        groups=len(groups), error=error)

    def _failover(self, rid: str, why: str, live: dict[str, dict]) -> None:
        handle = self.rollouts.pop(rid)
        self._started.pop(rid, None)
        self.loops.pop(rid, None)
        self.counters["dead"] += 1
        # only an actor: ray.kill on an in-process rollout (unit tests) would auto-start a local Ray
        if isinstance(handle, ray.actor.ActorHandle):
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        groups, partials = call(self.data.orphans, rid, timeout=CALL_TIMEOUT_S)
        by_group: dict[str, list] = {}
        for p in partials:
            by_group.setdefault(p.group_id, []).append(p)
        requeue = []
        for g in groups:
            ps = by_group.get(g.group_id, [])
            versions = {int(p.token_versions.min()) for p in ps if p.num_tokens}
            target = None
            if len(ps) == g.group_size and len(versions) == 1:
                v = versions.pop()
                same = self._pool(rid).engine
                target = next((r for r, s in live.items() if s["version"] == v and self._pool(r).engine == same), None)
            try:
                adopted = target is not None and call(self.rollouts[target].adopt, v, [g],
                                                      [p.moved_to(target) for p in ps], timeout=CALL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the target died or hung too: re-queue instead
                adopted = False
            if adopted:
                call(self.data.reassign, [g.group_id], target, timeout=CALL_TIMEOUT_S)
                self.counters["reissued_groups"] += 1
            else:
                requeue.append(g.group_id)
        if requeue:
            call(self.data.requeue, requeue, timeout=CALL_TIMEOUT_S)
        self.counters["requeued_groups"] += len(requeue)
        print(f"manager: rollout {rid} is dead ({why}); {len(groups) - len(requeue)} groups re-issued, "
              f"{len(requeue)} re-queued", flush=True)
        self._event("rollout_dead", rollout=rid, reason=why, groups=len(groups),
                    reissued=len(groups) - len(requeue), requeued=len(requeue))

    # ------------------------------------------------------------------ reporting
    def _event(self, kind: str, **fields) -> None:
        with self._lock:
            self._events.append({"kind": kind, "t": time.time(), **fields})

    def drain_events(self) -> list[dict]:
        with self._lock:
            out, self._events = self._events, []
            return out

    def report(self) -> dict:
        """Counters, live rollout ids, last stats; `starting`: live rollouts that have not reported
        weights yet (compiling); `restartable`: whether a dead rollout would still be replaced."""
        return {"counters": dict(self.counters), "live": sorted(self.rollouts), "stats": self.last_stats,
                "starting": sorted(self._started), "restarts": self.restarts,
                "restartable": self.spawn is not None and self.restarts < self.cfg.manager.max_restarts}

    def handles(self) -> dict[str, Any]:
        """Live rollout handles by id (the driver's view after restarts)."""
        return dict(self.rollouts)

    def loop_refs(self) -> dict[str, Any]:
        return dict(self.loops)
