"""Records that flow between the data module's actors: plain, picklable, numpy-only.

    PromptRow          one prompt of a dataset or built-in task (text, answer, the raw row)
    PromptGroup        a prompt issued to one rollout, to be sampled G times on one version
    PartialTrajectory  an unfinished response streamed to the PartialPool
    Trajectory         a finished response with its reward, as the ExperienceBuffer keeps it
    DroppedGroup       a group the buffer threw away (too stale, or evicted when full)

Token arrays are int64 numpy arrays, log-prob arrays float32, per-token versions int64. Every
record has `to_dict()` / `from_dict()` with JSON-safe values (lists, not arrays), which is what
the pools' `state_dict()` use, so a checkpoint can be written with `json.dump`.

`loss_mask` (float32, one per response token) is 1 on tokens the policy generated and 0 on
tokens it did not (tool outputs, environment text of a multi-turn trajectory); those carry no
log-prob of the policy (behaviour_logp 0), no gradient and count in no loss normaliser. None
means all ones: a single-turn response.

Log-prob naming follows `rollout/engine.py`: `behaviour_logp` is the engine's untruncated,
temperature-1 log-prob of each token (its `raw_logp`, what importance ratios use);
`sample_logp` the log-prob under the distribution actually sampled from (its `logp`, what a
resumed request needs as `prefix_logp`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from laminar_jax.arrays import int_ids as _ints
from laminar_jax.arrays import per_token_floats as _floats

FINISH_REASONS = ("stop", "length", "abort")


def request_id(group_id: str, sample_index: int) -> str:
    """The engine request id of sample `sample_index` of group `group_id`."""
    return f"{group_id}/{sample_index}"


def parse_request_id(rid: str) -> tuple[str, int]:
    """Inverse of `request_id`: `(group_id, sample_index)`."""
    group_id, sep, index = rid.rpartition("/")
    if not sep or not index.isdigit():
        raise ValueError(f"request id {rid!r}: expected '<group_id>/<sample_index>'")
    return group_id, int(index)


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)


def _normalise_tokens(record, where: str) -> None:
    """Checked arrays for a record's prompt, response, per-token log-probs and versions."""
    _set(record, "prompt_tokens", _ints(record.prompt_tokens, f"{where}: prompt_tokens"))
    resp = _ints(record.response_tokens, f"{where}: response_tokens")
    _set(record, "response_tokens", resp)
    n = resp.shape[0]
    _set(record, "behaviour_logp", _floats(record.behaviour_logp, f"{where}: behaviour_logp", n, "response token"))
    _set(record, "sample_logp", _floats(record.sample_logp, f"{where}: sample_logp", n, "response token"))
    versions = _ints(record.token_versions, f"{where}: token_versions")
    if versions.shape[0] != n:
        raise ValueError(f"{where}: token_versions has {versions.shape[0]} values for {n} tokens")
    _set(record, "token_versions", versions)
    _set(record, "loss_mask", _loss_mask(record.loss_mask, f"{where}: loss_mask", n))


def _loss_mask(values, what: str, n: int) -> np.ndarray:
    """float32 [n] of 0/1: 1 on tokens the policy generated (trained on), 0 on tool outputs and
    environment text. None (a single-turn response) is all ones."""
    if values is None:
        return np.ones((n,), np.float32)
    m = np.asarray(values, np.float32).reshape(-1)
    if m.shape[0] != n:
        raise ValueError(f"{what} has {m.shape[0]} values for {n} response tokens")
    if not np.isin(m, (0.0, 1.0)).all():
        raise ValueError(f"{what} must hold only 0 and 1")
    return m


def _plain(value):
    """JSON-safe copy: arrays and numpy scalars to python, containers recursively."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _to_dict(record) -> dict:
    return {f.name: _plain(getattr(record, f.name)) for f in dataclasses.fields(record)}


def _from_dict(cls, data: Mapping):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__}.from_dict: unknown fields {sorted(unknown)}")
    return cls(**dict(data))


@dataclass(frozen=True)
class PromptRow:
    """One prompt: its id, text, reference answer (None when the reward needs none) and the row.

    `row` is the dataset row as read (plain python values); user rewards receive it.
    `source` says where it came from ("file.jsonl line 12", "task countdown").
    """

    prompt_id: str
    prompt: str
    answer: Any = None
    row: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""

    to_dict = _to_dict
    from_dict = classmethod(_from_dict)


@dataclass(frozen=True, eq=False)
class PromptGroup:
    """A prompt issued to one rollout: `group_size` samples, all generated on one weight version.

    `group_id` is unique per (epoch, position) of the pool's cursor and survives re-queues;
    `attempt` counts how often the group went back to the pool (a dead rollout's group).
    """

    group_id: str
    prompt_id: str
    prompt: str
    prompt_tokens: np.ndarray
    answer: Any
    row: Mapping[str, Any]
    group_size: int
    epoch: int
    index: int
    attempt: int = 0

    def __post_init__(self):
        _set(self, "prompt_tokens", _ints(self.prompt_tokens, f"group {self.group_id!r}: prompt_tokens"))
        if self.group_size < 1:
            raise ValueError(f"group {self.group_id!r}: group_size must be >= 1, got {self.group_size}")

    def request_ids(self) -> list[str]:
        return [request_id(self.group_id, i) for i in range(self.group_size)]

    to_dict = _to_dict
    from_dict = classmethod(_from_dict)


@dataclass(frozen=True, eq=False)
class PartialTrajectory:
    """An unfinished (or just finished, `finish_reason` set) response, as streamed by a rollout.

    `token_versions[t]` is the weight version token t was generated on; trajectories resumed
    across versions (mode "partial") carry several. `repack_count` counts moves between rollouts.
    `episode`: a multi-turn trajectory's state at its last turn boundary (turns, counts, chat
    messages, the environment's snapshot; `rollout.multiturn`), JSON data, so that another
    rollout can continue it; None for a single-turn response.
    """

    group_id: str
    sample_index: int
    rollout_id: str
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    behaviour_logp: np.ndarray
    sample_logp: np.ndarray
    token_versions: np.ndarray
    prompt_id: str = ""
    repack_count: int = 0
    finish_reason: str | None = None
    loss_mask: np.ndarray | None = None
    episode: Mapping[str, Any] | None = None

    def __post_init__(self):
        where = f"partial {request_id(self.group_id, self.sample_index)}"
        _normalise_tokens(self, where)
        if self.episode is not None and not isinstance(self.episode, Mapping):
            raise ValueError(f"{where}: episode must be a mapping or None, got {type(self.episode).__name__}")
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"{where}: finish_reason {self.finish_reason!r} not in {FINISH_REASONS} or None")

    @property
    def key(self) -> tuple[str, int]:
        return (self.group_id, self.sample_index)

    @property
    def num_tokens(self) -> int:
        return int(self.response_tokens.shape[0])

    def moved_to(self, rollout_id: str) -> "PartialTrajectory":
        """The same trajectory handed to another rollout (repack or failover)."""
        return dataclasses.replace(self, rollout_id=rollout_id, repack_count=self.repack_count + 1)

    to_dict = _to_dict
    from_dict = classmethod(_from_dict)


@dataclass(frozen=True, eq=False)
class Trajectory:
    """A finished response with everything the learner and the trajectory log need.

    gen_version: the weight version the producer reports (the engine's version at the last
    token). `oldest_version` (min of `token_versions`) is what staleness is measured from, so a
    mixed-version trajectory counts as old as its oldest token.
    timings: wall-clock seconds, e.g. {"issued": t0, "first_token": t1, "finished": t2}.
    """

    group_id: str
    prompt_id: str
    sample_index: int
    rollout_id: str
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    behaviour_logp: np.ndarray
    sample_logp: np.ndarray
    token_versions: np.ndarray
    gen_version: int
    reward: float
    finish_reason: str
    repack_count: int = 0
    timings: Mapping[str, float] = field(default_factory=dict)
    loss_mask: np.ndarray | None = None
    turn_stats: Mapping[str, float] = field(default_factory=dict)   # multi-turn: turns, tool calls, ...

    def __post_init__(self):
        where = f"trajectory {request_id(self.group_id, self.sample_index)}"
        _normalise_tokens(self, where)
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"{where}: finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(self.reward)):
            raise ValueError(f"{where}: reward must be a finite float, got {self.reward!r}")
        _set(self, "reward", float(self.reward))
        _set(self, "gen_version", int(self.gen_version))
        _set(self, "timings", {str(k): float(v) for k, v in dict(self.timings).items()})
        _set(self, "turn_stats", {str(k): float(v) for k, v in dict(self.turn_stats).items()})

    @property
    def num_tokens(self) -> int:
        return int(self.response_tokens.shape[0])

    @property
    def oldest_version(self) -> int:
        return int(self.token_versions.min()) if self.num_tokens else self.gen_version

    @property
    def mixed_versions(self) -> bool:
        return self.num_tokens > 0 and int(self.token_versions.min()) != int(self.token_versions.max())

    def staleness(self, learner_version: int) -> int:
        """learner_version - oldest_version (paper section 6: M - K)."""
        return int(learner_version) - self.oldest_version

    def log_row(self, learner_version: int | None = None) -> dict:
        """One row of `trajectories.parquet` (ids, lengths, reward, versions, rollout, times)."""
        row = {
            "group_id": self.group_id, "prompt_id": self.prompt_id, "sample_index": self.sample_index,
            "rollout_id": self.rollout_id, "prompt_len": int(self.prompt_tokens.shape[0]),
            "response_len": self.num_tokens, "reward": self.reward, "finish_reason": self.finish_reason,
            "gen_version": self.gen_version, "oldest_version": self.oldest_version,
            "mixed_versions": self.mixed_versions, "repack_count": self.repack_count,
        }
        if learner_version is not None:
            row["staleness"] = self.staleness(learner_version)
        row.update({f"t_{k}": v for k, v in self.timings.items()})
        row.update({f"env_{k}": v for k, v in self.turn_stats.items()})
        return row

    to_dict = _to_dict
    from_dict = classmethod(_from_dict)


@dataclass(frozen=True)
class DroppedGroup:
    """A group the buffer discarded. reason: "stale" (filter) or "evicted" (buffer full)."""

    group_id: str
    prompt_id: str
    reason: str
    gen_version: int
    learner_version: int | None = None

    @property
    def staleness(self) -> int | None:
        return None if self.learner_version is None else self.learner_version - self.gen_version

    to_dict = _to_dict
    from_dict = classmethod(_from_dict)
