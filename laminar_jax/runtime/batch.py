"""Batch assembly: finished trajectories -> fixed-shape padded arrays for the learner step.

One row per trajectory, prompt then response, right-padded to a length bucket (a power of two,
at least `min_len`, at most `max_seq_len`: `length_buckets`), so the jitted step compiles once
per bucket and the set of shapes is known up front. `pack` then lays a mini-batch out
first-fit-decreasing into rows of `max_seq_len` (several segments per row, positions restarting
at 0 in each), with a row count from `row_buckets`. Per-token
arrays are aligned with `tokens`: position t of a row holds the log-prob, mask and staleness of
token t, and `learner.logprobs.sequence_logprobs` gives the learner's log-prob of token t at the
same position. Pure numpy: no jax, no Ray, no clock.

    tokens, positions, segment_ids  int32 [B, L]   (segment 1 = the row's sequence, 0 = padding)
    response_mask                   float32 [B, L] (1 on response tokens the policy generated:
                                    the trajectory's loss_mask, 0 on tool outputs)
    behaviour_logp                  float32 [B, L] (engine raw log-prob of each response token)
    staleness                       float32 [B, L] (learner_version - version of each token)
    rewards                         float32 [B];  group_ids int32 [B] (0..num_groups-1)
    response_len                    int32 [B]; valid float32 [B] (0: a padding row, no trajectory)

Packed (`pack`), only the per-token arrays (and `advantages`, `prox_logp`, `ref_logp` when
present) remain, as [R, max_seq_len] with segment ids 1..k inside each row.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from laminar_jax.data.records import Trajectory


TOKEN_KEYS = ("tokens", "positions", "segment_ids", "response_mask", "behaviour_logp", "staleness",
              "advantages", "prox_logp", "ref_logp")


def length_buckets(max_len: int, min_len: int = 16) -> tuple[int, ...]:
    """Every row length `bucket_len` can return: powers of two from min_len up, then max_len."""
    out, n = [], 1 << (max(min_len, 1) - 1).bit_length()
    while n < max_len:
        out.append(n)
        n *= 2
    return tuple(out) + (max_len,)


def row_reach(cfg, prompt_lengths: Sequence[int]) -> int | None:
    """The longest row (prompt + response tokens) a trajectory of this run can make: the longest
    prompt with room for rollout.max_new_tokens (longer ones are rejected by the rollouts) plus
    those tokens, at most learner.max_seq_len. None with an environment (its turns and tool output
    add tokens) or when no prompt fits. Unpacked, no batch needs a length bucket past it."""
    if cfg.env.name is not None:
        return None
    max_len, new = cfg.learner.max_seq_len, cfg.rollout.max_new_tokens
    fits = [n for n in prompt_lengths if n <= max_len - new]
    return min(max_len, max(fits) + new) if fits else None


def row_buckets(num_trajectories: int, multiple: int = 1) -> tuple[int, ...]:
    """Every packed row count `pack` can return for a mini-batch of `num_trajectories`:
    multiple * 2^k, then num_trajectories rounded up to the multiple (one trajectory per row)."""
    top = -(-num_trajectories // multiple) * multiple
    out, n = [], multiple
    while n < top:
        out.append(n)
        n *= 2
    return tuple(out) + (top,)


def reject_too_long(groups: Sequence[Sequence[Trajectory]], max_seq_len: int) -> tuple[list, int]:
    """Drop trajectories longer than learner.max_seq_len (never cut them); returns the groups
    (empty ones removed) and how many were rejected, for the caller's event and metric."""
    kept, rejected = [], 0
    for group in groups:
        ok = [t for t in group if t.prompt_tokens.shape[0] + t.num_tokens <= max_seq_len]
        rejected += len(group) - len(ok)
        if ok:
            kept.append(ok)
    return kept, rejected


def bucket_len(n: int, *, max_len: int, min_len: int = 16) -> int:
    """Smallest power of two >= max(n, min_len), capped at max_len; ValueError when n > max_len."""
    if n > max_len:
        raise ValueError(f"learner.max_seq_len={max_len} is shorter than a trajectory of {n} tokens "
                         f"(prompt + response); raise learner.max_seq_len or lower rollout.max_new_tokens")
    return min(1 << (max(n, min_len) - 1).bit_length(), max_len)


def assemble(groups: Sequence[Sequence[Trajectory]], *, learner_version: int, max_seq_len: int,
             min_len: int = 16, pad_id: int = 0, rows: int | None = None,
             length: int | None = None) -> dict[str, np.ndarray]:
    """Arrays of the module docstring for whole groups (group i's trajectories get group id i);
    `rows` pads the batch with empty rows (valid 0) up to a fixed row count. `length` fixes the
    row length (the hosts of a multi-host learner agree on one); with it and `rows`, no groups
    give a batch of padding rows only."""
    trajs = [(gi, t) for gi, group in enumerate(groups) for t in group]
    if not trajs and not (rows and length):
        raise ValueError("batch.assemble: no trajectories")
    lengths = [t.prompt_tokens.shape[0] + t.num_tokens for _, t in trajs]
    if length is None:
        length = bucket_len(max(lengths), max_len=max_seq_len, min_len=min_len)
    elif lengths and max(lengths) > length:
        raise ValueError(f"batch.assemble: length={length} is shorter than a trajectory of {max(lengths)} tokens")
    b = max(len(trajs), rows or 0)
    out = {
        "tokens": np.full((b, length), pad_id, np.int32),
        "positions": np.zeros((b, length), np.int32),
        "segment_ids": np.zeros((b, length), np.int32),
        "response_mask": np.zeros((b, length), np.float32),
        "behaviour_logp": np.zeros((b, length), np.float32),
        "staleness": np.zeros((b, length), np.float32),
        "rewards": np.zeros((b,), np.float32),
        "group_ids": np.zeros((b,), np.int32),
        "response_len": np.zeros((b,), np.int32),
        "valid": np.zeros((b,), np.float32),
    }
    for row, ((gi, t), n) in enumerate(zip(trajs, lengths)):
        p = t.prompt_tokens.shape[0]
        out["tokens"][row, :p] = t.prompt_tokens
        out["tokens"][row, p:n] = t.response_tokens
        out["positions"][row, :n] = np.arange(n)
        out["segment_ids"][row, :n] = 1
        out["response_mask"][row, p:n] = t.loss_mask  # 0 on tool outputs: no loss, no normaliser
        out["behaviour_logp"][row, p:n] = t.behaviour_logp
        out["staleness"][row, p:n] = learner_version - t.token_versions
        out["rewards"][row] = t.reward
        out["group_ids"][row] = gi
        out["response_len"][row] = t.num_tokens
        out["valid"][row] = 1.0
    out["group_ids"][len(trajs):] = max(len(groups) - 1, 0)  # padding rows: any group, valid 0
    return out


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each summing to <= capacity: items longest first, each into the
    first bin with room (Johnson 1973; at most 11/9 OPT + 6/9 bins)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise ValueError(f"batch.pack: a sequence of {lengths[i]} tokens exceeds learner.max_seq_len={capacity}")
        for j, r in enumerate(room):
            if r >= lengths[i]:
                bins[j].append(i)
                room[j] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack(batch: dict[str, np.ndarray], *, max_seq_len: int, row_multiple: int = 1,
         min_rows: int = 0) -> dict[str, np.ndarray]:
    """The per-token arrays of an assembled (unpacked) batch, packed first-fit-decreasing into
    rows of `max_seq_len`; the row count is the smallest of `row_buckets` that holds them (and
    at least `min_rows`: the hosts of a multi-host learner agree on one). Each
    trajectory keeps its tokens, positions and per-token values; its segment id is its slot in
    the row (1..k). Padding rows of the input (valid 0) are left out."""
    n_rows = batch["tokens"].shape[0]
    places = pack_places(batch, max_seq_len=max_seq_len)
    used = 1 + max((r for _, r, _, _ in places), default=-1)
    rows = next(r for r in row_buckets(n_rows, row_multiple) if r >= max(used, min_rows))
    keys = [k for k in TOKEN_KEYS if k in batch]
    out = {k: np.zeros((rows, max_seq_len), batch[k].dtype) for k in keys}
    slot: dict[int, int] = {}   # a trajectory's segment id is its slot in the row (1..k)
    for i, r, col, n in places:
        slot[r] = slot.get(r, 0) + 1
        for k in keys:
            out[k][r, col:col + n] = batch[k][i, :n]
        out["segment_ids"][r, col:col + n] = slot[r]
    return out


def pack_places(batch: dict[str, np.ndarray], *, max_seq_len: int) -> list[tuple[int, int, int, int]]:
    """Where `pack` puts each valid row of the batch: (row, packed row, column, length), rows
    first-fit-decreasing into `max_seq_len`, each bin's members in order of its fill."""
    n_rows = batch["tokens"].shape[0]
    valid = batch.get("valid", np.ones((n_rows,), np.float32)) > 0
    lengths = (batch["segment_ids"] != 0).sum(axis=1)
    items = [i for i in range(n_rows) if valid[i] and lengths[i] > 0]
    places = []
    for r, members in enumerate(first_fit_decreasing([int(lengths[i]) for i in items], max_seq_len)):
        col = 0
        for j in members:
            places.append((items[j], r, col, int(lengths[items[j]])))
            col += int(lengths[items[j]])
    return places


def unpack(packed: np.ndarray, batch: dict[str, np.ndarray], *, max_seq_len: int) -> np.ndarray:
    """A per-token array of `pack(batch)`'s rows ([packed rows, max_seq_len]) back in the batch's
    rows ([rows, length]); 0 where the batch has no token (padding, invalid rows)."""
    out = np.zeros(batch["tokens"].shape, np.asarray(packed).dtype)
    for i, r, col, n in pack_places(batch, max_seq_len=max_seq_len):
        out[i, :n] = packed[r, col:col + n]
    return out


def layout(batch: dict[str, np.ndarray], mini_batches: int, *, pack_rows: bool, max_seq_len: int,
           row_multiple: int = 1) -> list[dict[str, np.ndarray]]:
    """The mini-batches a learner update trains on: `split`, then `pack` each when packing."""
    parts = split(batch, mini_batches)
    if not pack_rows:
        return parts
    return [pack(mb, max_seq_len=max_seq_len, row_multiple=row_multiple) for mb in parts]


def split(batch: dict[str, np.ndarray], num_parts: int) -> list[dict[str, np.ndarray]]:
    """Contiguous row slices (whole groups stay together when rows are grouped and num_parts
    divides the number of groups)."""
    rows = batch["tokens"].shape[0]
    if rows % num_parts:
        raise ValueError(f"batch.split: {rows} rows do not split into {num_parts} equal mini-batches")
    size = rows // num_parts
    return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(num_parts)]


def staleness_stats(groups: Sequence[Sequence[Trajectory]], learner_version: int) -> dict[str, float]:
    """Per-trajectory staleness (learner_version - oldest token version) summary for metrics."""
    s = np.asarray([t.staleness(learner_version) for g in groups for t in g], np.float64)
    mixed = np.mean([t.mixed_versions for g in groups for t in g])
    return {"staleness_mean": float(s.mean()), "staleness_max": float(s.max()), "staleness_min": float(s.min()),
            **{f"staleness_frac_{k}": float(np.mean(s == k)) for k in range(4)},
            "staleness_frac_4plus": float(np.mean(s >= 4)), "mixed_version_frac": float(mixed)}


@dataclasses.dataclass(frozen=True)
class TrajectoryStats:
    """What a step's metrics read of one consumed trajectory (`staleness_stats`, the tool and
    reward metrics): a multi-host learner's hosts send these to the leader, not the trajectory."""

    reward: float
    num_tokens: int
    oldest_version: int
    mixed_versions: bool
    turn_stats: Mapping[str, float]

    @classmethod
    def of(cls, t: Trajectory) -> "TrajectoryStats":
        return cls(reward=float(t.reward), num_tokens=t.num_tokens, oldest_version=t.oldest_version,
                   mixed_versions=bool(t.mixed_versions), turn_stats=dict(t.turn_stats))

    def staleness(self, learner_version: int) -> int:
        return int(learner_version) - self.oldest_version
