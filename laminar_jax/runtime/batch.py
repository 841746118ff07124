"""Batch assembly: finished trajectories -> fixed-shape padded arrays for the learner step.

One row per trajectory, prompt then response, right-padded to a length bucket (a power of two,
at least `min_len`, at most `max_seq_len`), so the jitted step compiles once per bucket. Per-token
arrays are aligned with `tokens`: position t of a row holds the log-prob, mask and staleness of
token t, and `learner.logprobs.sequence_logprobs` gives the learner's log-prob of token t at the
same position. Pure numpy: no jax, no Ray, no clock.

    tokens, positions, segment_ids  int32 [B, L]   (segment 1 = the row's sequence, 0 = padding)
    response_mask                   float32 [B, L] (1 on response tokens)
    behaviour_logp                  float32 [B, L] (engine raw log-prob of each response token)
    staleness                       float32 [B, L] (learner_version - version of each token)
    rewards                         float32 [B];  group_ids int32 [B] (0..num_groups-1)
    response_len                    int32 [B]
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from laminar_jax.data.records import Trajectory


def bucket_len(n: int, *, max_len: int, min_len: int = 16) -> int:
    """Smallest power of two >= max(n, min_len), capped at max_len; ValueError when n > max_len."""
    if n > max_len:
        raise ValueError(f"learner.max_seq_len={max_len} is shorter than a trajectory of {n} tokens "
                         f"(prompt + response); raise learner.max_seq_len or lower rollout.max_new_tokens")
    return min(1 << (max(n, min_len) - 1).bit_length(), max_len)


def assemble(groups: Sequence[Sequence[Trajectory]], *, learner_version: int, max_seq_len: int,
             min_len: int = 16, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Arrays of the module docstring for whole groups (group i's trajectories get group id i)."""
    trajs = [(gi, t) for gi, group in enumerate(groups) for t in group]
    if not trajs:
        raise ValueError("batch.assemble: no trajectories")
    lengths = [t.prompt_tokens.shape[0] + t.num_tokens for _, t in trajs]
    length = bucket_len(max(lengths), max_len=max_seq_len, min_len=min_len)
    b = len(trajs)
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
    }
    for row, ((gi, t), n) in enumerate(zip(trajs, lengths)):
        p = t.prompt_tokens.shape[0]
        out["tokens"][row, :p] = t.prompt_tokens
        out["tokens"][row, p:n] = t.response_tokens
        out["positions"][row, :n] = np.arange(n)
        out["segment_ids"][row, :n] = 1
        out["response_mask"][row, p:n] = 1.0
        out["behaviour_logp"][row, p:n] = t.behaviour_logp
        out["staleness"][row, p:n] = learner_version - t.token_versions
        out["rewards"][row] = t.reward
        out["group_ids"][row] = gi
        out["response_len"][row] = t.num_tokens
    return out


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
