"""The experience buffer: finished groups, sampled whole by the learner.

`put(group)` takes all G trajectories of one prompt group at once; `sample(k, learner_version)`
returns k whole groups (or none, if fewer than k are left after the staleness filter). A full
buffer either refuses (`put` returns False: back-pressure, the producer waits and retries) or
evicts a group, by the eviction policy. The optional staleness filter drops, counts and reports
(`pop_dropped`) every group whose oldest token is more than `max_staleness` versions behind the
learner version passed to `sample` (paper section 6: staleness = M - K).

Delivery is idempotent: a group id seen before (a duplicate from a rollout declared dead, or a
group regenerated after a restore) is counted and not stored again, and `put` returns True so the
producer does not retry. The ledger satisfies received = buffered + consumed + dropped_stale +
evicted; `ledger_balance` joins it with the prompt pool's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from laminar_jax.data.records import DroppedGroup, Trajectory
from laminar_jax.data.samplers import EvictionPolicy, Sampler, make_eviction, make_sampler

STATE_FORMAT = 1
MAX_DROPPED_RECORDS = 10_000


@dataclass(eq=False)
class BufferedGroup:
    """A group in the buffer. gen_version: the oldest token version of its trajectories."""

    group_id: str
    prompt_id: str
    seq: int
    gen_version: int
    trajectories: tuple[Trajectory, ...]


def _check_group(trajectories: Sequence[Trajectory]) -> tuple[str, str]:
    if not trajectories:
        raise ValueError("ExperienceBuffer.put: empty group (expected the G trajectories of one prompt group)")
    first = trajectories[0]
    for t in trajectories:
        if not isinstance(t, Trajectory):
            raise ValueError(f"ExperienceBuffer.put: expected Trajectory records, got {type(t).__name__}")
        if (t.group_id, t.prompt_id) != (first.group_id, first.prompt_id):
            raise ValueError(f"ExperienceBuffer.put: one group must share group_id and prompt_id; got "
                             f"{(first.group_id, first.prompt_id)} and {(t.group_id, t.prompt_id)}")
    indices = sorted(t.sample_index for t in trajectories)
    if indices != list(range(len(trajectories))):
        raise ValueError(f"ExperienceBuffer.put: group {first.group_id!r} has sample indices {indices}, "
                         f"expected 0..{len(trajectories) - 1} (whole groups only)")
    return first.group_id, first.prompt_id


class ExperienceBuffer:
    """Finished groups (module docstring).

    capacity_groups: groups held at most. sampler: "fifo" | "newest" | "uniform" | import path |
    a Sampler. eviction: "block" | "drop_oldest" | "drop_stalest" | import path | a policy.
    max_staleness: drop groups older than this many versions (None = keep everything).
    """

    def __init__(self, capacity_groups: int = 64, *, sampler: str | Sampler = "fifo",
                 eviction: str | EvictionPolicy = "block", max_staleness: int | None = None, seed: int = 0):
        if capacity_groups < 1:
            raise ValueError(f"ExperienceBuffer: capacity_groups must be >= 1, got {capacity_groups}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"ExperienceBuffer: max_staleness must be None or >= 0, got {max_staleness}")
        self.capacity_groups = capacity_groups
        self.max_staleness = max_staleness
        self._sampler = make_sampler(sampler, seed)
        self._eviction = make_eviction(eviction)
        self._groups: list[BufferedGroup] = []
        self._seen: set[str] = set()
        self._seq = 0
        self._learner_version: int | None = None
        self._dropped: list[DroppedGroup] = []
        self._counters = dict(received=0, consumed=0, dropped_stale=0, evicted=0, duplicates=0,
                              rejected_full=0, consumed_trajectories=0)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._groups)

    def size(self) -> int:
        return len(self._groups)

    def num_trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self._groups)

    def group_ids(self) -> list[str]:
        return [g.group_id for g in self._groups]

    def seen(self, group_id: str) -> bool:
        return group_id in self._seen

    def seen_among(self, group_ids: Sequence[str]) -> list[str]:
        """The ids this buffer has received: a manager re-queuing a dead rollout's groups completes
        these instead (the rollout died between `put` and `complete`)."""
        return [g for g in group_ids if g in self._seen]

    def staleness(self, learner_version: int) -> list[int]:
        """learner_version - gen_version of each buffered group, in arrival order."""
        return [learner_version - g.gen_version for g in self._groups]

    def accounting(self) -> dict[str, int]:
        """Ledger counts; received == buffered + consumed + dropped_stale + evicted."""
        return dict(buffered=len(self._groups), buffered_trajectories=self.num_trajectories(),
                    capacity=self.capacity_groups, **self._counters)

    def pop_dropped(self) -> list[DroppedGroup]:
        """Groups dropped (stale or evicted) since the last call, for the event log."""
        out, self._dropped = self._dropped, []
        return out

    # ------------------------------------------------------------------ operations
    def _record_drop(self, g: BufferedGroup, reason: str, learner_version: int | None) -> None:
        self._counters["dropped_stale" if reason == "stale" else "evicted"] += 1
        if len(self._dropped) < MAX_DROPPED_RECORDS:
            self._dropped.append(DroppedGroup(g.group_id, g.prompt_id, reason, g.gen_version, learner_version))

    def drop_stale(self, learner_version: int) -> int:
        """Apply the staleness filter now; returns how many groups it dropped."""
        self._learner_version = int(learner_version)
        if self.max_staleness is None:
            return 0
        keep, stale = [], []
        for g in self._groups:
            (stale if learner_version - g.gen_version > self.max_staleness else keep).append(g)
        self._groups = keep
        for g in stale:
            self._record_drop(g, "stale", int(learner_version))
        return len(stale)

    def put(self, trajectories: Sequence[Trajectory]) -> bool:
        """Add one whole group. False means "full, try again later" (back-pressure)."""
        group_id, prompt_id = _check_group(trajectories)
        if group_id in self._seen:
            self._counters["duplicates"] += 1
            return True
        if len(self._groups) >= self.capacity_groups and self._learner_version is not None:
            self.drop_stale(self._learner_version)
        if len(self._groups) >= self.capacity_groups:
            victim = self._eviction.victim(self._groups)
            if victim is None:
                self._counters["rejected_full"] += 1
                return False
            if not 0 <= victim < len(self._groups):
                raise ValueError(f"ExperienceBuffer.put: eviction policy returned {victim!r}, expected an "
                                 f"index in [0, {len(self._groups)}) or None")
            self._record_drop(self._groups.pop(victim), "evicted", self._learner_version)
        gen_version = min(t.oldest_version for t in trajectories)
        ordered = tuple(sorted(trajectories, key=lambda t: t.sample_index))
        self._groups.append(BufferedGroup(group_id, prompt_id, self._seq, gen_version, ordered))
        self._seq += 1
        self._seen.add(group_id)
        self._counters["received"] += 1
        return True

    def sample(self, num_groups: int, learner_version: int, *, allow_fewer: bool = False) -> list[list[Trajectory]]:
        """`num_groups` whole groups chosen by the sampler, after the staleness filter.

        With fewer groups left, returns [] (nothing consumed) unless `allow_fewer`.
        """
        if num_groups < 1:
            raise ValueError(f"ExperienceBuffer.sample: num_groups must be >= 1, got {num_groups}")
        self.drop_stale(learner_version)
        if len(self._groups) < num_groups and not allow_fewer:
            return []
        k = min(num_groups, len(self._groups))
        if k == 0:
            return []
        picked = self._sampler.select(self._groups, k)
        if len(set(picked)) != k or not all(0 <= i < len(self._groups) for i in picked):
            raise ValueError(f"ExperienceBuffer.sample: sampler returned {picked}, expected {k} distinct "
                             f"indices in [0, {len(self._groups)})")
        chosen = [self._groups[i] for i in picked]
        for i in sorted(picked, reverse=True):
            self._groups.pop(i)
        self._counters["consumed"] += k
        self._counters["consumed_trajectories"] += sum(len(g.trajectories) for g in chosen)
        return [list(g.trajectories) for g in chosen]

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """JSON-safe snapshot: buffered groups, seen ids, counters, sampler state."""
        return {
            "format": STATE_FORMAT, "seq": self._seq, "learner_version": self._learner_version,
            "groups": [{"seq": g.seq, "trajectories": [t.to_dict() for t in g.trajectories]}
                       for g in self._groups],
            "seen": sorted(self._seen), "counters": dict(self._counters),
            "sampler": self._sampler.state_dict(),
            "dropped": [d.to_dict() for d in self._dropped],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"ExperienceBuffer: checkpoint format {state.get('format')!r}, expected {STATE_FORMAT}")
        self._groups = []
        for g in state["groups"]:
            trajs = tuple(Trajectory.from_dict(t) for t in g["trajectories"])
            group_id, prompt_id = _check_group(trajs)
            self._groups.append(BufferedGroup(group_id, prompt_id, int(g["seq"]),
                                              min(t.oldest_version for t in trajs), trajs))
        self._seq = int(state["seq"])
        self._learner_version = state["learner_version"]
        self._seen = set(state["seen"])
        self._counters = {k: int(state["counters"].get(k, 0)) for k in self._counters}
        self._sampler.load_state_dict(state["sampler"])
        self._dropped = [DroppedGroup.from_dict(d) for d in state.get("dropped", [])]


def ledger_balance(pool: dict, buffer: dict) -> dict[str, int]:
    """Join the prompt pool's and the buffer's `accounting()` into one ledger.

        issued = in_flight + requeued + buffered + consumed + dropped - double_held

    double_held = received (buffer) - completed (pool): groups the buffer has but the pool still
    holds as in flight or re-queued, because their producer died between `put` and `complete`.
    They resolve when re-delivered (the buffer drops the duplicate, the pool completes them), or
    at once if the manager completes `buffer.seen_among(ids)` before re-queuing. `unaccounted`
    (issued minus the right-hand side) is 0 unless a group was lost or counted twice.
    """
    dropped = buffer["dropped_stale"] + buffer["evicted"]
    double_held = buffer["received"] - pool["completed"]
    held = pool["in_flight"] + pool["requeued"] + buffer["buffered"] + buffer["consumed"] + dropped
    return dict(issued=pool["issued"], in_flight=pool["in_flight"], requeued=pool["requeued"],
                buffered=buffer["buffered"], consumed=buffer["consumed"], dropped=dropped,
                double_held=double_held, unaccounted=pool["issued"] - (held - double_held))
