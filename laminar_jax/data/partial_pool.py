"""The partial-response pool: in-flight trajectories, streamed by rollouts (paper sections 2, 7).

Rollouts send a snapshot of each running trajectory every few tokens or seconds (the whole
response so far, so an update is idempotent). When a rollout dies, the manager takes its
trajectories (`take_for`) and hands them to a rollout on the same weight version, or re-queues
the prompt group when there is none; so a dead rollout costs only the tokens generated since its
last snapshot. The pool is also the live view of generation for online analysis (`stats`).

An update replaces the stored snapshot of (group_id, sample_index) unless it is older: a lower
repack count (a late message from the rollout the trajectory moved away from) or, at the same
repack count, fewer tokens. Those are counted as `stale_updates` and ignored.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

from laminar_jax.data.records import PartialTrajectory

STATE_FORMAT = 1


class PartialPool:
    """In-flight trajectories keyed by (group_id, sample_index) (module docstring)."""

    def __init__(self):
        self._entries: dict[tuple[str, int], PartialTrajectory] = {}
        self._counters = dict(updates=0, stale_updates=0, taken=0, reassigned=0, dropped=0)

    def __len__(self) -> int:
        return len(self._entries)

    def update(self, partials: Sequence[PartialTrajectory]) -> int:
        """Store snapshots; returns how many were accepted (the rest were older than stored)."""
        accepted = 0
        for p in partials:
            if not isinstance(p, PartialTrajectory):
                raise ValueError(f"PartialPool.update: expected PartialTrajectory records, got {type(p).__name__}")
            old = self._entries.get(p.key)
            self._counters["updates"] += 1
            if old is not None and (p.repack_count, p.num_tokens) < (old.repack_count, old.num_tokens):
                self._counters["stale_updates"] += 1
                continue
            self._entries[p.key] = p
            accepted += 1
        return accepted

    def take_for(self, rollout_id: str, *, reassign_to: str | None = None) -> list[PartialTrajectory]:
        """Trajectories held by `rollout_id`, for re-issue.

        Without `reassign_to` they leave the pool (the caller re-issues them, whose new holder
        streams them back, or re-queues their groups). With it they stay, owned by `reassign_to`
        with their repack count + 1, and the moved records are returned.
        """
        mine = [p for p in self._entries.values() if p.rollout_id == rollout_id]
        mine.sort(key=lambda p: p.key)
        if reassign_to is None:
            for p in mine:
                del self._entries[p.key]
            self._counters["taken"] += len(mine)
            return mine
        moved = [p.moved_to(reassign_to) for p in mine]
        for p in moved:
            self._entries[p.key] = p
        self._counters["reassigned"] += len(moved)
        return moved

    def drop_groups(self, group_ids: str | Iterable[str]) -> int:
        """Forget every trajectory of these groups (delivered to the buffer, or re-queued)."""
        gids = {group_ids} if isinstance(group_ids, str) else set(group_ids)
        keys = [k for k in self._entries if k[0] in gids]
        for k in keys:
            del self._entries[k]
        self._counters["dropped"] += len(keys)
        return len(keys)

    def get(self, *, group_id: str | None = None, rollout_id: str | None = None) -> list[PartialTrajectory]:
        return sorted((p for p in self._entries.values()
                       if (group_id is None or p.group_id == group_id)
                       and (rollout_id is None or p.rollout_id == rollout_id)), key=lambda p: p.key)

    def stats(self) -> dict:
        """Trajectories and tokens in flight, per rollout and per version, and mixed-version count."""
        entries = list(self._entries.values())
        versions: Counter = Counter()
        for p in entries:
            versions.update(p.token_versions.tolist())
        return {
            "trajectories": len(entries),
            "tokens": sum(p.num_tokens for p in entries),
            "finished": sum(p.finish_reason is not None for p in entries),
            "by_rollout": dict(Counter(p.rollout_id for p in entries)),
            "tokens_by_version": {int(v): int(c) for v, c in sorted(versions.items())},
            "mixed_version": sum(p.num_tokens > 0 and p.token_versions.min() != p.token_versions.max()
                                 for p in entries),
            "max_repack_count": max((p.repack_count for p in entries), default=0),
            **self._counters,
        }

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "entries": [p.to_dict() for p in self.get()],
                "counters": dict(self._counters)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"PartialPool: checkpoint format {state.get('format')!r}, expected {STATE_FORMAT}")
        self._entries = {}
        for d in state["entries"]:
            p = PartialTrajectory.from_dict(d)
            self._entries[p.key] = p
        self._counters = {k: int(state["counters"].get(k, 0)) for k in self._counters}
