"""The simulated experience buffer: the runtime's capacity and when-full rules, in groups.

Same semantics and config keys as the runtime's `laminar_jax.data.buffer.ExperienceBuffer`
behind `runtime.data_actor.DataActor` (`data.buffer_groups`, `data.buffer_when_full`):

- a finished group is delivered whole; while fewer than `capacity` groups are buffered it is
  stored (arrival order);
- a full buffer asks the eviction policy (the runtime's own objects from
  `laminar_jax.data.samplers.make_eviction`: "block", "drop_oldest", "drop_stalest" or an
  import path) for a victim: None (block) refuses the group and the rollout keeps it
  (`rollout/worker.py`: `undelivered`, retried every tick; meanwhile the rollout takes no new
  prompts but keeps decoding what it has); otherwise the victim is dropped (counted as evicted)
  and the new group stored;
- the learner takes whole groups (FIFO, the paper's sampler [P App. A.2], or the groups of its
  global batch in the global-batch modes), which frees room: held groups are then retried in the
  order they were refused (the runtime retries per rollout tick; the simulator has no ticks).

With `max_staleness` set (the simulator sets the asynchronous modes' bound, as the runtime's
`DataActor` sets AReaL's eta on its `ExperienceBuffer`), `drop_stale(learner_version)` drops
the buffered groups more than that many versions behind the learner (the runtime's
`ExperienceBuffer.drop_stale`): groups that finished so far out of order that the issue gate
could not bound them.

Records carry `seq` (arrival number) and `gen_version` (the oldest version among the group's
trajectories), the two fields the runtime's eviction policies read.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from laminar_jax.data.samplers import make_eviction

__all__ = ["SimBuffer", "BufferedGroup"]


@dataclass(eq=False)
class BufferedGroup:
    group: int            # prompt group id of the simulator's TrajStore
    seq: int
    gen_version: int
    tag: int = -1         # the policy's label (global batch index in global-batch modes)


class SimBuffer:
    """Groups waiting for the learner, plus the groups rollouts hold because it was full."""

    def __init__(self, capacity: int, when_full: str, max_staleness: int | None = None, *,
                 group_size: int = 1):
        if capacity < 1:
            raise ValueError(f"data.buffer_groups: expected an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self.when_full = when_full
        self._eviction = make_eviction(when_full)
        self.groups: deque[BufferedGroup] = deque()
        self.held: deque[tuple[BufferedGroup, int]] = deque()    # (record, rollout index)
        self._seq = 0
        self.evicted: list[BufferedGroup] = []
        self.refused = 0
        self.max_staleness = max_staleness
        self.dropped_stale: list[BufferedGroup] = []
        self.group_size = group_size
        self.dropped_trajectories = 0       # in the dropped groups (group_size each)

    def __len__(self) -> int:
        return len(self.groups)

    def record(self, group: int, gen_version: int, tag: int = -1) -> BufferedGroup:
        return BufferedGroup(group, -1, gen_version, tag)

    def _store(self, rec: BufferedGroup) -> None:
        rec.seq = self._seq
        self._seq += 1
        self.groups.append(rec)

    def put(self, rec: BufferedGroup) -> bool:
        """Store `rec` (evicting a victim if the policy names one); False = refused (block)."""
        if len(self.groups) < self.capacity:
            self._store(rec)
            return True
        victim = self._eviction.victim(self.groups)
        if victim is None:
            self.refused += 1
            return False
        if not 0 <= victim < len(self.groups):
            raise ValueError(f"data.buffer_when_full {self.when_full!r}: victim {victim!r} is not "
                             f"an index in [0, {len(self.groups)})")
        out = self.groups[victim]
        del self.groups[victim]
        self.evicted.append(out)
        self._store(rec)
        return True

    def deliver(self, rec: BufferedGroup, rollout: int) -> bool:
        """A rollout delivers a finished group; a refused one is held (FIFO) for a retry."""
        if self.held or not self.put(rec):
            # groups refused earlier go first, as each runtime rollout retries its oldest first
            self.held.append((rec, rollout))
            return False
        return True

    def retry(self) -> list[tuple[BufferedGroup, int]]:
        """Deliver held groups while there is room; returns the delivered (record, rollout)."""
        out = []
        while self.held and self.put(self.held[0][0]):
            out.append(self.held.popleft())
        return out

    def drop_stale(self, learner_version: int) -> int:
        """Drop buffered groups with learner_version - gen_version > max_staleness; how many."""
        bound = self.max_staleness
        if bound is None or not self.groups:
            return 0
        keep = deque()
        for r in self.groups:
            (self.dropped_stale if learner_version - r.gen_version > bound else keep).append(r)
        dropped = len(self.groups) - len(keep)
        self.groups = keep
        self.dropped_trajectories += dropped * self.group_size
        return dropped

    def take_fifo(self, count: int) -> list[BufferedGroup] | None:
        """The `count` oldest groups, or None (nothing taken) when fewer are buffered."""
        if len(self.groups) < count:
            return None
        pop = self.groups.popleft
        return [pop() for _ in range(count)]

    def take_tagged(self, tag: int, count: int) -> list[BufferedGroup] | None:
        """The `count` oldest groups labelled `tag` (the runtime's BatchSampler), or None."""
        picked = [r for r in self.groups if r.tag == tag][:count]
        if len(picked) < count:
            return None
        chosen = set(map(id, picked))
        self.groups = deque(r for r in self.groups if id(r) not in chosen)
        return picked
