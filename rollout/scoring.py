"""A rollout's finished groups: decoded, scored off the decode loop, turned into trajectories.

    finished group -> decode texts -> reward pool (async) -> rewards -> Trajectory records

A group's rewards are computed by the reward pool while the engine keeps decoding; `collect()`
returns the groups whose rewards are in. A completion the tokenizer cannot decode, and a reward
that raises, is not finite or is not a number, scores 0 and is counted and reported as an event:
one bad sample never stops the loop, and never goes unreported.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from laminar_jax.data.records import PromptGroup, Trajectory


@dataclass
class GroupState:
    """One prompt group in a rollout, from its issue to its delivery."""
    group: PromptGroup
    issued: float
    done: dict = field(default_factory=dict)          # sample index -> PartialTrajectory (finished)
    repacks: dict = field(default_factory=dict)       # sample index -> repack count
    timings: dict = field(default_factory=dict)       # sample index -> (first_token, finished)
    env: dict = field(default_factory=dict)           # multi-turn: sample index -> (reward, turn stats)


class GroupScorer:
    """`GroupScorer(rollout_id, tokenizer, stop_token_ids, reward, counters, event)`.

    reward: a `RewardScorer` (`submit_group(group, texts) -> pending`, `pending.done()`,
    `pending.results()`). counters: the worker's counter dict (`decode_errors`, `reward_errors`).
    event(kind, **fields): the worker's event log.
    """

    def __init__(self, rollout_id: str, tokenizer: Any, stop_token_ids, reward: Any, counters: dict,
                 event: Callable[..., None]):
        self.rollout_id, self.tokenizer, self.reward = rollout_id, tokenizer, reward
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.counters, self._event = counters, event
        self._pending: list = []  # (group, texts, pending rewards)

    def busy(self) -> bool:
        """Groups whose rewards are still being computed."""
        return bool(self._pending)

    def wait(self, timeout_s: float) -> None:
        """Block until the oldest group being scored has its rewards (`collect` takes it) or
        `timeout_s` passed. A pending object without `wait` (a test double) is polled."""
        if not self._pending:
            return
        pending = self._pending[0][2]
        if isinstance(pending, Exception) or pending.done():
            return
        if hasattr(pending, "wait"):
            pending.wait(timeout_s)
        else:
            time.sleep(min(timeout_s, 0.002))

    def submit(self, group: GroupState) -> None:
        """Decode a finished group and start its rewards (the reward pool works while we decode)."""
        g = group.group
        texts = [self._decode(group.done[i].response_tokens, (g.group_id, i)) for i in range(g.group_size)]
        try:
            pending = self.reward.submit_group(g, [t for t in texts if t is not None])
        except Exception as e:  # noqa: BLE001 - reported by _scores
            pending = e
        self._pending.append((group, texts, pending))

    def collect(self, version: int) -> list[list[Trajectory]]:
        """The trajectories of every group whose rewards are in, in submission order.
        version: the engine's weight version (the gen_version of a sample with no tokens)."""
        ready, still = [], []
        for group, texts, pending in self._pending:
            if isinstance(pending, Exception) or pending.done():
                ready.append(self.trajectories(group, self._scores(group.group, texts, pending), version))
            else:
                still.append((group, texts, pending))
        self._pending = still
        return ready

    def trajectories(self, group: GroupState, rewards: list[float], version: int) -> list[Trajectory]:
        g = group.group
        out = []
        for i, reward in enumerate(rewards):
            p = group.done[i]
            first, done = group.timings.get(i, (time.time(), time.time()))
            out.append(Trajectory(g.group_id, g.prompt_id, i, self.rollout_id, p.prompt_tokens, p.response_tokens,
                                  p.behaviour_logp, p.sample_logp, p.token_versions,
                                  int(p.token_versions[-1]) if p.num_tokens else version,
                                  reward, p.finish_reason,
                                  p.repack_count, {"issued": group.issued, "first_token": first, "finished": done},
                                  loss_mask=p.loss_mask, turn_stats=group.env.get(i, (0.0, {}))[1]))
        return out

    def _decode(self, tokens, key) -> str | None:
        """The completion text, or None (logged and counted) when the tokenizer cannot decode it."""
        try:
            return self.tokenizer.decode([int(x) for x in tokens if int(x) not in self.stop_token_ids])
        except Exception as e:  # noqa: BLE001 - a bad id must cost one sample, never the loop
            self.counters["decode_errors"] += 1
            self._event("decode_error", group_id=key[0], sample_index=key[1], error=f"{type(e).__name__}: {e}")
            return None

    def _scores(self, g: PromptGroup, texts: list[str | None], pending) -> list[float]:
        """Rewards of a group; a reward that raises or is not finite scores 0, logged and counted."""
        out = [0.0] * len(texts)
        ok = [i for i, t in enumerate(texts) if t is not None]
        try:
            if isinstance(pending, Exception):
                raise pending
            results = pending.results()
        except Exception as e:  # noqa: BLE001 - a reward that is not a RewardScorer may raise
            self.counters["reward_errors"] += len(ok)
            self._event("reward_error", group_id=g.group_id, error=f"{type(e).__name__}: {e}")
            return out
        for i, result in zip(ok, results):
            if result.error is not None:
                self.counters["reward_errors"] += 1
                fields = result.error.to_event()
                fields["error_kind"] = fields.pop("kind", None)  # "kind" names the event itself
                self._event("reward_error", **fields)
            elif not np.isfinite(result.value):
                self.counters["reward_errors"] += 1
                self._event("reward_error", group_id=g.group_id, sample_index=i, error=f"value {result.value}")
            else:
                out[i] = float(result.value)
        return out
