"""Dynamic repack: best-fit consolidation of ramp-down rollouts (Laminar, arXiv 2510.12633, §5).

A rollout's KV-cache use ramps up to C_max, stays there while queued requests refill freed
space, and falls once nothing is waiting [P §5.2, Fig 9]. From then on it only drains a long
tail of trajectories. Repack moves the tails of such rollouts onto other ramp-down rollouts
running the SAME weight version, so the released rollouts can pull new weights and start a new
batch early [P §5.1, Fig 8].

Algorithm 1 of the paper (Best-Fit Trajectory Consolidation), per weight-version group:

    S = {r : r.C_used < min(C_max, r.C_prev) and r.N_reqs < B}      (ramp-down and small)
    for s in S by ascending C_used:                                 (smallest footprint first)
        D = {d in S \\ E, d != s : C_load(d) + s.C_used <= C_max and N_load(d) + s.N_reqs <= B}
        if D: move s -> argmax_{d in D} C_load(d); E += {s}          (best fit = densest)

where C_load(d) / N_load(d) are d's own KV use / running count plus everything already moved
onto d. Cost O(|S|^2) time, O(|S|) space.

Deviations, both [I]:
- Guard: a rollout that has been chosen as a destination is never released afterwards. The
  paper's pseudocode allows it, and it would then account only for the source's own load,
  silently dropping the trajectories it had received.
- A rollout with no running trajectories is not a candidate: it has nothing to move, and
  filling it with old-version work would keep it from starting its next batch.

This module is pure python (no jax, Ray, I/O or clock): the rollout manager and the cluster
simulator call the same `plan`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable

__all__ = ["RolloutLoad", "Move", "is_candidate", "plan"]


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutLoad:
    """One rollout's progress sample, as the manager collects it.

    Attributes:
      id: unique rollout id.
      version: weight version the rollout is generating with.
      kv_used: KV-cache utilisation now (C_used; any unit, same as `c_max`).
      kv_prev: KV-cache utilisation at the previous sample (C_prev).
      num_running: trajectories running on the rollout now (N_reqs).
    """

    id: str
    version: int
    kv_used: float
    kv_prev: float
    num_running: int

    def __post_init__(self):
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"repack.RolloutLoad.id: expected a non-empty str, got {self.id!r}")
        for name in ("version", "num_running"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(
                    f"repack.RolloutLoad.{name} of rollout {self.id!r}: expected an int, "
                    f"got {value!r}"
                )
        if self.num_running < 0:
            raise ValueError(
                f"repack.RolloutLoad.num_running of rollout {self.id!r}: expected >= 0, "
                f"got {self.num_running}"
            )
        for name in ("kv_used", "kv_prev"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                math.isfinite(value) and value >= 0
            ):
                raise ValueError(
                    f"repack.RolloutLoad.{name} of rollout {self.id!r}: expected a finite number "
                    f">= 0, got {value!r}"
                )


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    """Move all unfinished trajectories of rollout `source` onto rollout `destination`.

    Both run weight version `version`; the source is released and pulls new weights.
    """

    source: str
    destination: str
    version: int


def _check_hparams(c_max, roofline_batch):
    if isinstance(c_max, bool) or not isinstance(c_max, numbers.Real) or not (
        math.isfinite(c_max) and c_max > 0
    ):
        raise ValueError(f"repack.plan: c_max must be a finite number > 0, got {c_max!r}")
    batch = roofline_batch
    if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
        raise ValueError(
            f"repack.plan: roofline_batch must be an int >= 1, got {roofline_batch!r}"
        )


def is_candidate(load: RolloutLoad, *, c_max: float, roofline_batch: int) -> bool:
    """Whether a rollout is in ramp-down and small enough to take part in repack.

    C_used < min(C_max, C_prev) and 0 < N_reqs < B  [P §5.2, Alg. 1 line 1; the N_reqs > 0 part
    is ours, see the module docstring]. The comparison with C_prev is strict as in the
    pseudocode, so a rollout whose KV use holds steady is not yet ramping down.
    """
    return (
        load.kv_used < c_max
        and load.kv_used < load.kv_prev
        and 0 < load.num_running < roofline_batch
    )


def plan(rollout_loads: Iterable[RolloutLoad], *, c_max: float, roofline_batch: int) -> list[Move]:
    """Repack moves for one fleet sample: Algorithm 1 of [P §5] per weight-version group.

    Args:
      rollout_loads: one `RolloutLoad` per rollout (ids unique; any order).
      c_max: KV-cache threshold C_max; no destination's KV load may exceed it after the moves.
      roofline_batch: roofline batch size B; no destination may run more than B trajectories
        after the moves.

    Returns:
      Moves ordered by version, then by the order Algorithm 1 makes them. Each source appears
      once; no source is a destination; source and destination share `version`. The result
      depends only on the set of loads, not their order. Tie-breaks: candidates are visited by
      (kv_used, id); among destinations with equal KV load the smallest id wins.
    """
    _check_hparams(c_max, roofline_batch)
    groups: dict[int, list[RolloutLoad]] = {}
    seen: set[str] = set()
    for load in rollout_loads:
        if load.id in seen:
            raise ValueError(f"repack.plan: rollout id {load.id!r} appears more than once")
        seen.add(load.id)
        if is_candidate(load, c_max=c_max, roofline_batch=roofline_batch):
            groups.setdefault(load.version, []).append(load)

    moves: list[Move] = []
    for version in sorted(groups):
        cands = sorted(groups[version], key=lambda r: (r.kv_used, r.id))
        n = len(cands)
        if n < 2:
            continue
        ids = [r.id for r in cands]
        c_load = [r.kv_used for r in cands]
        n_load = [r.num_running for r in cands]
        # Rollouts still able to receive: not released. Kept in visiting order.
        open_idx = list(range(n))
        is_destination = [False] * n
        for i in range(n):
            # The guard: a destination's received work would travel again, a chain of moves.
            if is_destination[i]:
                continue
            c_s = c_load[i]
            n_s = n_load[i]
            n_room = roofline_batch - n_s
            best = -1
            best_c = -1.0
            for j in open_idx:
                if j == i:
                    continue
                cj = c_load[j]
                if cj + c_s > c_max:
                    continue
                if n_load[j] > n_room:
                    continue
                if cj > best_c or (cj == best_c and ids[j] < ids[best]):
                    best = j
                    best_c = cj
            if best < 0:
                continue
            c_load[best] += c_s
            n_load[best] += n_s
            is_destination[best] = True
            open_idx.remove(i)
            moves.append(Move(source=ids[i], destination=ids[best], version=version))
    return moves
