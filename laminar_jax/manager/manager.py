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

STATS_TIMEOUT_S = 30.0


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
    def __init__(self, cfg: Any, rollouts: dict[str, Any], data: Any):
        self.cfg, self.data = cfg, data
        self.rollouts = dict(rollouts)
        self.kv_prev: dict[str, float] = {}
        self.last_stats: dict[str, dict] = {}
        self._kick, self._stop = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self._events: list[dict] = []
        self.counters = dict(rounds=0, moves=0, moved_trajectories=0, failed_moves=0, dead=0,
                             reissued_groups=0, requeued_groups=0)
        self.repack = modes.repacks(cfg.manager.mode, enabled=cfg.manager.repack)
        # rollout id -> its pool (engine kind); a rollout named otherwise belongs to the first pool
        self.pools = dict(cfg.rollout.assignments())
        self._pool = lambda rid: self.pools.get(rid, cfg.rollout.pools_resolved()[0])

    def run(self) -> None:
        while not self._stop.is_set():
            self._kick.wait(self.cfg.manager.repack_interval_s)
            self._kick.clear()
            if not self._stop.is_set():
                self.round()

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
        # ask every rollout first, then wait: one slow rollout does not delay the others' asks
        refs = {rid: h.stats.remote() if hasattr(h.stats, "remote") else h.stats for rid, h in self.rollouts.items()}
        stats, dead = {}, []
        for rid, ref in refs.items():
            try:
                s = ray.get(ref, timeout=STATS_TIMEOUT_S) if isinstance(ref, ray.ObjectRef) else ref()
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                dead.append((rid, f"{type(e).__name__}"))
                continue
            if s["failed"]:
                dead.append((rid, s["failed"]))
            else:
                stats[rid] = s
        self.last_stats = stats
        for rid, why in dead:
            self._failover(rid, why, stats)
        return stats

    def _move(self, source: str, destination: str, version: int) -> None:
        t0 = time.time()
        got = call(self.rollouts[source].release, version)
        if got is None:
            return
        groups, partials = got
        moved = [p.moved_to(destination) for p in partials]
        gids = [g.group_id for g in groups]
        try:
            ok, error = call(self.rollouts[destination].adopt, version, groups, moved), None
            overhead_s = time.time() - t0  # the moved trajectories decode nowhere meanwhile
        except Exception as e:  # noqa: BLE001 - a destination that fails must not stop repack
            ok, error = False, f"{type(e).__name__}: {e}"
        if ok:
            call(self.data.reassign, gids, destination)
            send(self.data.update_partials, moved)
            self.counters["moves"] += 1
            self.counters["moved_trajectories"] += len(moved)
            self._event("repack", source=source, destination=destination, version=version,
                        groups=len(groups), trajectories=len(moved),
                        unfinished=sum(p.finish_reason is None for p in moved), group_ids=gids,
                        overhead_s=overhead_s)
        else:  # the destination moved on to newer weights meanwhile: regenerate, never mix versions
            call(self.data.requeue, gids)
            self.counters["failed_moves"] += 1
            self._event("repack_refused", source=source, destination=destination, version=version,
                        groups=len(groups), error=error)

    def _failover(self, rid: str, why: str, live: dict[str, dict]) -> None:
        handle = self.rollouts.pop(rid)
        self.counters["dead"] += 1
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        groups, partials = call(self.data.orphans, rid)
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
            if target is not None and call(self.rollouts[target].adopt, v, [g], [p.moved_to(target) for p in ps]):
                call(self.data.reassign, [g.group_id], target)
                self.counters["reissued_groups"] += 1
            else:
                requeue.append(g.group_id)
        if requeue:
            call(self.data.requeue, requeue)
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
        return {"counters": dict(self.counters), "live": sorted(self.rollouts), "stats": self.last_stats}
