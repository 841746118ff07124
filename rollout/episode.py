"""A multi-turn trajectory's state (`Episode`) and its JSON form, `PartialTrajectory.episode`.

    episode_state(ep, phase)   the state at the last turn boundary: phase "decode" (a turn is in
                               the engine; the record's tokens after `turn_tokens` are its tokens
                               so far) or "step" (its env.step is pending on `last_text`)
    done_state(reward, stats, timings)   a finished trajectory waiting for the rest of its group
    restored(partial, env, version, now) the Episode to continue on another rollout

JSON data only (the partial pool and the learner checkpoint store it with `json`); no Ray, no JAX.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from laminar_jax.data.records import PartialTrajectory
from laminar_jax.env.protocol import COUNT_KEYS, EnvStateError

EPISODE_FORMAT = 1


@dataclass
class Episode:
    """One trajectory across its turns."""

    rid: str
    env: Any
    messages: list
    prompt_tokens: np.ndarray
    version: int
    started: float
    tokens: list = field(default_factory=list)
    logp: list = field(default_factory=list)
    raw_logp: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    turns: int = 0
    cached_tokens: int = 0       # context tokens of later turns the engine did not prefill again
    context_tokens: int = 0      # context tokens of later turns (prompt + response so far)
    reward: float = 0.0
    counts: dict = field(default_factory=lambda: dict.fromkeys(COUNT_KEYS, 0))
    env_s: float = 0.0
    first_token: float | None = None
    pending: Any = None            # the future of the env.step in flight
    pending_since: float = 0.0
    last_text: str = ""
    last_finish: str = "stop"
    env_state: dict | None = None  # the env's snapshot at the last turn boundary (None: cannot move)



def episode_state(ep: Episode, phase: str) -> dict:
    return {"format": EPISODE_FORMAT, "phase": phase, "version": ep.version, "turn_tokens": len(ep.tokens),
            "turns": ep.turns, "counts": dict(ep.counts), "reward": ep.reward, "messages": list(ep.messages),
            "env": ep.env_state, "env_s": ep.env_s, "cached_tokens": ep.cached_tokens,
            "context_tokens": ep.context_tokens, "first_token": ep.first_token, "last_text": ep.last_text,
            "last_finish": ep.last_finish}


def done_state(reward: float, stats: dict, timings) -> dict:
    """What the worker needs to deliver a finished trajectory from another rollout: the
    environment's reward, the turn stats, the timings."""
    return {"format": EPISODE_FORMAT, "phase": "done", "reward": float(reward), "stats": dict(stats),
            "timings": list(timings)}


def is_done_state(episode) -> bool:
    return isinstance(episode, dict) and episode.get("format") == EPISODE_FORMAT and episode.get("phase") == "done"


def check_state(partial: PartialTrajectory, name: str) -> None:
    """Raise EnvStateError (naming env `name`) unless `partial` carries a state to continue."""
    rid = f"{partial.group_id}/{partial.sample_index}"
    d = partial.episode
    if not isinstance(d, dict) or d.get("format") != EPISODE_FORMAT or d.get("phase") not in ("decode", "step"):
        raise EnvStateError(f"env {name!r}: trajectory {rid} carries no episode state to continue "
                            f"(format {None if not isinstance(d, dict) else d.get('format')!r})")
    n = int(d["turn_tokens"])
    if not 0 <= n <= partial.num_tokens:
        raise EnvStateError(f"env {name!r}: trajectory {rid}: turn_tokens={n} for {partial.num_tokens} tokens")


def restored(partial: PartialTrajectory, env: Any, version: int, now: float) -> Episode:
    """The episode of a checked record (`check_state`), on `env` (restored) and `version`: its
    tokens up to the last turn boundary; the rest, if any, is the prefix of its next request."""
    d, n = partial.episode, int(partial.episode["turn_tokens"])
    mask = np.asarray(partial.loss_mask, np.float32)
    return Episode(f"{partial.group_id}/{partial.sample_index}", env, [dict(m) for m in d["messages"]],
                   partial.prompt_tokens, version, now,
                   tokens=partial.response_tokens[:n].tolist(), logp=partial.sample_logp[:n].tolist(),
                   raw_logp=partial.behaviour_logp[:n].tolist(), versions=partial.token_versions[:n].tolist(),
                   mask=mask[:n].tolist(), turns=int(d["turns"]), cached_tokens=int(d["cached_tokens"]),
                   context_tokens=int(d["context_tokens"]), reward=float(d["reward"]),
                   counts={k: int(d["counts"].get(k, 0)) for k in COUNT_KEYS}, env_s=float(d["env_s"]),
                   first_token=d["first_token"], last_text=str(d["last_text"]), last_finish=str(d["last_finish"]),
                   env_state=d["env"])
