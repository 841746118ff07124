"""The prompt pool: a seeded cursor over the prompts and a ledger of every issued group.

Cursor: position p = epoch * N + index walks the prompts in the order of a permutation drawn
from (seed, epoch) (identity when shuffle is off), so the order is a function of the seed alone.
The group at position p has id "e{epoch}-{index}"; p < cursor means "issued".

Ledger: an issued group is in flight (held by a rollout), re-queued (waiting at the front, e.g.
its rollout died) or completed (delivered to the experience buffer). Hence, always,

    issued = in_flight + requeued + completed,

A producer calls `buffer.put(group)` and then `pool.complete(group_id)`; joined with the
buffer's ledger (received = buffered + consumed + dropped) this gives
issued = in_flight + requeued + buffered + consumed + dropped, up to groups caught between the two
calls (`laminar_jax.data.buffer.ledger_balance`). A group is issued once however often it is
re-queued, and `complete` is idempotent (a late duplicate from a rollout declared dead is counted
and ignored), so no group is lost or counted twice.

Checkpoint order: snapshot this pool before the experience buffer. A group delivered between the
two snapshots is then "in flight" here and "received" there; on restore it is re-queued,
regenerated, and the buffer drops the duplicate. The other order could lose it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from collections import OrderedDict, deque
from typing import Callable, Iterable, Sequence

import numpy as np

from laminar_jax.data.records import PromptGroup, PromptRow

_GROUP_ID = re.compile(r"^e(\d+)-(\d+)$")
STATE_FORMAT = 1


class PromptEncoder:
    """prompt text -> token ids, optionally through the tokenizer's chat template (one user turn).

    Works with `laminar_jax.models.tokenizer.HFTokenizer` and `CharTokenizer`; picklable, so a
    Ray actor can hold it.
    """

    def __init__(self, tokenizer, chat_template: bool = False):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def __call__(self, text: str) -> list[int]:
        if self.chat_template:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                           add_generation_prompt=True, tokenize=True))
        return list(self.tokenizer.encode(text))


def _as_list(group_ids: str | Iterable[str]) -> list[str]:
    return [group_ids] if isinstance(group_ids, str) else list(group_ids)


def fingerprint(rows: Sequence[PromptRow]) -> str:
    """A hash of the prompt ids and texts, to refuse restoring a cursor onto another dataset."""
    h = hashlib.sha256()
    for r in rows:
        h.update(r.prompt_id.encode())
        h.update(b"\0")
        h.update(r.prompt.encode())
        h.update(b"\1")
    return h.hexdigest()[:16]


class PromptPool:
    """Issues prompt groups to rollouts and keeps the ledger (module docstring).

    rows: the prompts. group_size: samples per prompt (G). max_epochs: stop after this many
    passes (0 = cycle forever). encode: text -> token ids (None leaves `prompt_tokens` empty for
    the caller to fill).
    """

    def __init__(self, rows: Sequence[PromptRow], *, group_size: int, seed: int = 0, shuffle: bool = True,
                 max_epochs: int = 0, encode: Callable[[str], Sequence[int]] | None = None,
                 name: str = "prompts"):
        if not rows:
            raise ValueError(f"PromptPool {name!r}: no prompts")
        if group_size < 1:
            raise ValueError(f"PromptPool {name!r}: group_size must be >= 1, got {group_size}")
        if max_epochs < 0:
            raise ValueError(f"PromptPool {name!r}: max_epochs must be >= 0 (0 = forever), got {max_epochs}")
        self.name = name
        self._rows = list(rows)
        self._fingerprint = fingerprint(self._rows)
        self.group_size = group_size
        self.seed = seed
        self.shuffle = shuffle
        self.max_epochs = max_epochs
        self._encode = encode
        self._perm_cache: dict[int, np.ndarray] = {}
        self._position = 0
        self._requeued: deque[PromptGroup] = deque()
        self._in_flight: OrderedDict[str, tuple[PromptGroup, str]] = OrderedDict()
        self._counters = dict(completed=0, requeue_events=0, reissues=0, duplicate_completions=0,
                              ignored_requeues=0)

    # ------------------------------------------------------------------ cursor
    @property
    def num_prompts(self) -> int:
        return len(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def cursor(self) -> tuple[int, int]:
        """(epoch, index) of the next fresh group."""
        return divmod(self._position, len(self._rows))

    def _perm(self, epoch: int) -> np.ndarray:
        """Row order of `epoch` (cached for the few epochs that can be live at once)."""
        if epoch not in self._perm_cache:
            n = len(self._rows)
            if len(self._perm_cache) >= 4:
                self._perm_cache.pop(min(self._perm_cache))
            self._perm_cache[epoch] = (np.random.default_rng([self.seed, epoch]).permutation(n)
                                       if self.shuffle else np.arange(n))
        return self._perm_cache[epoch]

    def _fresh_exhausted(self) -> bool:
        return self.max_epochs > 0 and self._position >= self.max_epochs * len(self._rows)

    def exhausted(self) -> bool:
        """No fresh group left (max_epochs reached) and nothing re-queued."""
        return self._fresh_exhausted() and not self._requeued

    def _make_group(self, epoch: int, index: int, attempt: int = 0) -> PromptGroup:
        row = self._rows[int(self._perm(epoch)[index])]
        tokens = self._encode(row.prompt) if self._encode is not None else []
        return PromptGroup(f"e{epoch}-{index}", row.prompt_id, row.prompt, np.asarray(tokens, np.int64),
                           row.answer, row.row, self.group_size, epoch, index, attempt)

    def _parse(self, group_id: str) -> int:
        """Cursor position of `group_id`; ValueError if this pool never issued it."""
        m = _GROUP_ID.match(group_id)
        pos = None if m is None else int(m.group(1)) * len(self._rows) + int(m.group(2))
        if m is None or int(m.group(2)) >= len(self._rows) or pos >= self._position:
            raise ValueError(f"PromptPool {self.name!r}: group {group_id!r} was never issued by this pool")
        return pos

    # ------------------------------------------------------------------ operations
    def issue(self, n: int, rollout_id: str) -> list[PromptGroup]:
        """Up to n groups for `rollout_id`: re-queued ones first, then fresh ones from the cursor.

        Fewer than n only when `max_epochs` is reached.
        """
        out = []
        while len(out) < n and self._requeued:
            group = self._requeued.popleft()
            self._counters["reissues"] += 1
            out.append(group)
        while len(out) < n and not self._fresh_exhausted():
            epoch, index = self.cursor()
            out.append(self._make_group(epoch, index))
            self._position += 1
        for group in out:
            self._in_flight[group.group_id] = (group, rollout_id)
        return out

    def requeue(self, group_ids: str | Iterable[str]) -> list[str]:
        """Put in-flight groups back at the front (in the order given); returns those moved.

        Groups already completed or already re-queued are left alone and counted
        (`ignored_requeues`): a rollout may finish a group just before it is declared dead.
        """
        moved = []
        for gid in _as_list(group_ids):
            self._parse(gid)
            if gid not in self._in_flight:
                self._counters["ignored_requeues"] += 1
                continue
            group, _ = self._in_flight.pop(gid)
            moved.append(dataclasses.replace(group, attempt=group.attempt + 1))
        self._requeued.extendleft(reversed(moved))
        self._counters["requeue_events"] += len(moved)
        return [g.group_id for g in moved]

    def requeue_rollout(self, rollout_id: str) -> list[str]:
        """Re-queue every group in flight on `rollout_id` (a dead rollout), in issue order."""
        return self.requeue([gid for gid, (_, rid) in self._in_flight.items() if rid == rollout_id])

    def reassign(self, group_ids: str | Iterable[str], rollout_id: str) -> None:
        """Record that in-flight groups moved to `rollout_id` (repack, failover)."""
        for gid in _as_list(group_ids):
            if gid not in self._in_flight:
                raise ValueError(f"PromptPool {self.name!r}: cannot reassign group {gid!r}: not in flight")
            self._in_flight[gid] = (self._in_flight[gid][0], rollout_id)

    def complete(self, group_ids: str | Iterable[str]) -> int:
        """Mark groups delivered to the buffer; returns how many were newly completed."""
        done = 0
        for gid in _as_list(group_ids):
            self._parse(gid)
            if self._in_flight.pop(gid, None) is not None:
                done += 1
                continue
            for i, group in enumerate(self._requeued):
                if group.group_id == gid:
                    del self._requeued[i]
                    done += 1
                    break
            else:
                self._counters["duplicate_completions"] += 1
        self._counters["completed"] += done
        return done

    def status(self, group_id: str) -> str:
        """One of "in_flight", "requeued", "completed", "pending" (not issued yet)."""
        try:
            self._parse(group_id)
        except ValueError:
            if _GROUP_ID.match(group_id):
                return "pending"
            raise
        if group_id in self._in_flight:
            return "in_flight"
        if any(g.group_id == group_id for g in self._requeued):
            return "requeued"
        return "completed"

    def in_flight(self, rollout_id: str | None = None) -> list[PromptGroup]:
        return [g for g, rid in self._in_flight.values() if rollout_id is None or rid == rollout_id]

    def holders(self) -> dict[str, str]:
        """group id -> rollout id of every in-flight group."""
        return {gid: rid for gid, (_, rid) in self._in_flight.items()}

    def accounting(self) -> dict[str, int]:
        """Ledger counts; issued == in_flight + requeued + completed always holds."""
        epoch, index = self.cursor()
        return dict(issued=self._position, in_flight=len(self._in_flight), requeued=len(self._requeued),
                    epoch=epoch, index=index, num_prompts=len(self._rows), **self._counters)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """JSON-safe snapshot: cursor, re-queued and in-flight groups, counters."""
        return {
            "format": STATE_FORMAT, "name": self.name, "fingerprint": self._fingerprint,
            "num_prompts": len(self._rows), "group_size": self.group_size, "seed": self.seed,
            "shuffle": self.shuffle, "position": self._position,
            "requeued": [[g.epoch, g.index, g.attempt] for g in self._requeued],
            "in_flight": [[g.epoch, g.index, g.attempt, rid] for g, rid in self._in_flight.values()],
            "counters": dict(self._counters),
        }

    def load_state_dict(self, state: dict, *, requeue_in_flight: bool = True) -> None:
        """Restore a snapshot. In-flight groups go back to the front (after the re-queued ones),
        since the rollouts that held them are gone; `requeue_in_flight=False` keeps them in flight.
        """
        for key, mine in (("format", STATE_FORMAT), ("fingerprint", self._fingerprint),
                          ("num_prompts", len(self._rows)), ("group_size", self.group_size),
                          ("seed", self.seed), ("shuffle", self.shuffle)):
            if state.get(key) != mine:
                raise ValueError(f"PromptPool {self.name!r}: checkpoint has {key}={state.get(key)!r} but this "
                                 f"pool has {key}={mine!r}; it was saved for other prompts or settings")
        self._position = int(state["position"])
        self._counters = {k: int(state["counters"].get(k, 0)) for k in self._counters}
        self._requeued = deque(self._make_group(e, i, a) for e, i, a in state["requeued"])
        self._in_flight = OrderedDict()
        for e, i, a, rid in state["in_flight"]:
            if requeue_in_flight:
                self._requeued.append(self._make_group(e, i, a + 1))
                self._counters["requeue_events"] += 1
            else:
                group = self._make_group(e, i, a)
                self._in_flight[group.group_id] = (group, rid)
