"""Multi-turn trajectories: the turn loop between the engine and one environment per sample.

    requests = turns.start(group, version)   env.reset(row) -> prompt tokens, one request per sample
    turns.on_completion(c)                   a turn ended: env.step(text) runs in a thread pool
    continuations, finished = turns.poll(v)  tool results back: continue or finish trajectories

A turn ends at a stop token (or at rollout.max_new_tokens for that turn). Its text goes to
`env.step` on a worker thread, so the engine keeps decoding the other trajectories meanwhile.
When the step returns an observation, its tokens (`laminar_jax.env.chat.tool_turn_tokens`) are
appended to the SAME trajectory with loss mask 0 (behaviour log-prob 0, the trajectory's weight
version) and the trajectory is re-added to the engine as a request with that prefix. With
`env.kv_policy: keep` its requests carry `keep_kv`, so the engine kept the turn's K/V and prefills
only the tool's output; with "release" it re-prefills prompt + response so far. The worker gives
kept K/V back when a trajectory ends (`released()`). A trajectory keeps the weight
version it started on across all its turns: a turn decoded on another version raises (outside
modes that interrupt on publish), and the worker counts a waiting trajectory as in flight, so it
pulls no weights under it.

Limits (env config): max_turns policy turns, max_tool_calls tool calls (counted from the step's
info), max_total_tokens response tokens (policy + tool); a trajectory that reaches one ends with
finish_reason "length". An env.step that raises, returns garbage or outlives step_timeout_s ends
its trajectory with reward 0 and an all-zero loss mask (no gradient, no normaliser: dropped from
the loss while its group stays whole), counted in `counters["env_errors"]` and reported.

Moving between rollouts (repack, failover): `snapshot(engine_partials)` gives a record of every
live trajectory with `episode`, its state at the last turn boundary as JSON data (turns, counts,
reward so far, chat messages, the environment's `snapshot()`), and `resume(row, record, version)`
continues it on another rollout of the same engine kind and version: a trajectory that was
decoding re-prefills prompt + everything so far and goes on with its turn; one that was waiting
on env.step runs that step again on the restored environment (the step's result never left the
old rollout). An environment without snapshot / restore, or whose snapshot failed, gives
`episode` None: such a trajectory cannot move (the worker refuses the release).
No Ray and no laminar_jax.runtime import here.
"""
from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from laminar_jax.data.records import PartialTrajectory, request_id
from laminar_jax.env import chat
from laminar_jax.env.protocol import (COUNT_KEYS, EnvStateError, as_step_result, can_snapshot, restore_env,
                                      snapshot_state)
from rollout.engine import Request, SamplingParams
from rollout.episode import Episode, check_state, episode_state, restored


@dataclass(frozen=True)
class Finished:
    """A trajectory done with all its turns: the record (loss mask included), reward, stats."""

    partial: PartialTrajectory
    reward: float
    stats: dict
    timings: tuple[float, float]
    error: str | None = None


class MultiTurn:
    """The turn loop of one rollout worker (module docstring).

    make_env() -> a fresh environment; env_cfg: the EnvConfig (limits, timeouts, workers);
    sampling: the per-turn sampling (its max_new_tokens is the per-turn budget);
    decode(tokens) -> text (stop tokens left out); allow_mixed: the mode lets a trajectory
    continue on newer weights (partial rollout).
    """

    def __init__(self, make_env: Callable[[], Any], env_cfg: Any, tokenizer: Any, sampling: SamplingParams,
                 decode: Callable[[Any], str], *, rollout_id: str, allow_mixed: bool = False,
                 clock: Callable[[], float] = time.time):
        self.make_env, self.cfg, self.tokenizer = make_env, env_cfg, tokenizer
        self.sampling, self.decode, self.rollout_id = sampling, decode, rollout_id
        self.allow_mixed, self.clock = allow_mixed, clock
        self.episodes: dict[str, Episode] = {}
        self.pool = ThreadPoolExecutor(max_workers=env_cfg.workers, thread_name_prefix=f"env-{rollout_id}")
        self.counters = dict(turns=0, tool_calls=0, tool_errors=0, parse_errors=0, env_errors=0, env_timeouts=0,
                             env_s=0.0, limit_turns=0, limit_tool_calls=0, limit_tokens=0)
        self.errors: list[dict] = []   # env failures for the worker's event log
        self.state_errors: list[str] = []   # snapshots that failed (the trajectory cannot move)
        self._ended: list[str] = []    # trajectories done since the last released()

    # ------------------------------------------------------------------ start
    def start(self, group, version: int, indices=None) -> list[Request]:
        """One episode per sample of `group` (or the samples `indices`; env.reset on its row);
        their first requests. A reset that raises makes the episode finish at once (reported by
        `poll`)."""
        out = []
        rids = group.request_ids()
        for rid in rids if indices is None else [rids[i] for i in indices]:
            env = self.make_env()
            ep = Episode(rid, env, [], group.prompt_tokens, version, self.clock())
            self.episodes[rid] = ep
            try:
                ep.messages = list(env.reset(group.row))
                ep.prompt_tokens = np.asarray(chat.prompt_tokens(self.tokenizer, ep.messages), np.int64)
            except Exception as e:  # noqa: BLE001 - the user's environment
                ep.pending, ep.pending_since = _failed(f"env.reset raised {type(e).__name__}: {e}"), self.clock()
                continue
            self._save_state(ep)
            out.append(self._request(ep))
        return out

    def _request(self, ep: Episode, partial: PartialTrajectory | None = None) -> Request:
        """The episode's next request; with `partial` (a resumed turn) its tokens so far are the
        prefix, while the turn's budget still counts from the turn's start."""
        n = len(ep.tokens)
        budget = min(n + self.sampling.max_new_tokens, self.cfg.max_total_tokens)
        sampling = dataclasses.replace(self.sampling, max_new_tokens=budget)
        keep = self.cfg.kv_policy == "keep"
        gid = ep.rid.rpartition("/")[0]
        if partial is not None and partial.num_tokens > n:
            return Request(ep.rid, ep.prompt_tokens, sampling, gid, partial.response_tokens, partial.sample_logp,
                           partial.behaviour_logp, partial.token_versions, keep_kv=keep)
        if not n:
            return Request(ep.rid, ep.prompt_tokens, sampling, gid, keep_kv=keep)
        return Request(ep.rid, ep.prompt_tokens, sampling, gid, np.asarray(ep.tokens),
                       np.asarray(ep.logp, np.float32), np.asarray(ep.raw_logp, np.float32), np.asarray(ep.versions),
                       keep_kv=keep)

    def _save_state(self, ep: Episode) -> None:
        """The env's snapshot at a turn boundary (no env.step in flight), so the trajectory can
        move; a snapshot that fails is reported once per trajectory and pins it here."""
        ep.env_state = None
        if not can_snapshot(ep.env):
            return
        try:
            state = snapshot_state(ep.env, str(self.cfg.name))
            json.dumps(ep.messages)  # the chat so far travels with it
        except (EnvStateError, TypeError, ValueError) as e:
            self.state_errors.append(f"trajectory {ep.rid}: {e}")
            return
        ep.env_state = state

    # ------------------------------------------------------------------ a turn ended
    def owns(self, rid: str) -> bool:
        return rid in self.episodes

    def on_completion(self, c) -> None:
        """Record the turn's new tokens (loss mask 1) and start env.step on its text."""
        ep = self.episodes[c.request_id]
        n = len(ep.tokens)
        new = slice(n, None)
        versions = np.asarray(c.versions[new])
        if not self.allow_mixed and versions.size and (versions != ep.version).any():
            raise RuntimeError(f"multi-turn: trajectory {ep.rid} started on version {ep.version} but a turn "
                               f"was decoded on {sorted(set(versions.tolist()))}")
        ep.tokens += c.response_tokens[new].tolist()
        ep.logp += c.logp[new].tolist()
        ep.raw_logp += c.raw_logp[new].tolist()
        ep.versions += versions.tolist()
        ep.mask += [1.0] * len(versions)
        if ep.first_token is None:
            ep.first_token = c.timings.first_token or c.timings.finished
        if ep.turns:
            ep.context_tokens += len(ep.prompt_tokens) + n
            ep.cached_tokens += int(getattr(c, "num_cached_tokens", 0))
        ep.turns += 1
        self.counters["turns"] += 1
        ep.last_finish = c.finish_reason
        ep.last_text = self.decode(c.response_tokens[new])
        ep.pending_since = self.clock()
        ep.pending = self.pool.submit(ep.env.step, ep.last_text)

    def waiting(self) -> int:
        """Trajectories waiting on their environment (not in the engine)."""
        return sum(ep.pending is not None for ep in self.episodes.values())

    # ------------------------------------------------------------------ tool results back
    def poll(self, engine_version: int) -> tuple[list[Request], list[Finished]]:
        conts, done = [], []
        now = self.clock()
        for ep in list(self.episodes.values()):
            fut = ep.pending
            if fut is None:
                continue
            if not fut.done():
                if now - ep.pending_since > self.cfg.step_timeout_s:
                    done.append(self._fail(ep, f"env.step did not return within env.step_timeout_s="
                                               f"{self.cfg.step_timeout_s:g} s", timeout=True))
                continue
            ep.pending = None
            ep.env_s += now - ep.pending_since
            try:
                obs, reward, is_done, info = as_step_result(fut.result())
            except Exception as e:  # noqa: BLE001 - the user's environment
                done.append(self._fail(ep, f"{type(e).__name__}: {e}" if not isinstance(e, _EnvFailure) else str(e)))
                continue
            ep.reward += reward
            for k in COUNT_KEYS:
                ep.counts[k] += int(info.get(k, 0))
            for k in ("tool_calls", "tool_errors", "parse_errors"):
                self.counters[k] += int(info.get(k, 0))
            limit = self._limit(ep, is_done)
            if is_done or limit:
                done.append(self._finish(ep, ep.last_finish if is_done else "length"))
                continue
            obs_tokens = chat.tool_turn_tokens(self.tokenizer, ep.messages, ep.last_text, obs or "")
            ep.messages += [{"role": "assistant", "content": ep.last_text}, {"role": "tool", "content": obs or ""}]
            if len(ep.tokens) + len(obs_tokens) >= self.cfg.max_total_tokens:
                self.counters["limit_tokens"] += 1
                done.append(self._finish(ep, "length"))
                continue
            if not self.allow_mixed and engine_version != ep.version:
                raise RuntimeError(f"multi-turn: trajectory {ep.rid} is on version {ep.version} but the "
                                   f"engine moved to {engine_version} while it waited on its tool")
            ep.tokens += obs_tokens
            ep.logp += [0.0] * len(obs_tokens)
            ep.raw_logp += [0.0] * len(obs_tokens)
            ep.versions += [ep.version if not self.allow_mixed else engine_version] * len(obs_tokens)
            ep.mask += [0.0] * len(obs_tokens)
            self._save_state(ep)
            conts.append(self._request(ep))
        return conts, done

    def _limit(self, ep: Episode, is_done: bool) -> bool:
        if is_done:
            return False
        if ep.turns >= self.cfg.max_turns:
            self.counters["limit_turns"] += 1
            return True
        if ep.counts["tool_calls"] > self.cfg.max_tool_calls:
            self.counters["limit_tool_calls"] += 1
            return True
        if len(ep.tokens) >= self.cfg.max_total_tokens:
            self.counters["limit_tokens"] += 1
            return True
        return False

    def released(self) -> list[str]:
        """Ids of the trajectories that ended since the last call (the engine may hold their K/V)."""
        out, self._ended = self._ended, []
        return out

    def _finish(self, ep: Episode, finish_reason: str, error: str | None = None, timeout: bool = False) -> Finished:
        del self.episodes[ep.rid]
        self._ended.append(ep.rid)
        self.counters["env_s"] += ep.env_s
        gid, index = ep.rid.rpartition("/")[0], int(ep.rid.rpartition("/")[2])
        mask = np.zeros(len(ep.tokens), np.float32) if error else np.asarray(ep.mask, np.float32)
        partial = PartialTrajectory(group_id=gid, sample_index=index, rollout_id=self.rollout_id,
                                    prompt_tokens=ep.prompt_tokens, response_tokens=np.asarray(ep.tokens, np.int64),
                                    behaviour_logp=np.asarray(ep.raw_logp, np.float32),
                                    sample_logp=np.asarray(ep.logp, np.float32),
                                    token_versions=np.asarray(ep.versions, np.int64),
                                    finish_reason=finish_reason, loss_mask=mask)
        stats = {"turns": ep.turns, **{k: ep.counts[k] for k in COUNT_KEYS}, "env_s": ep.env_s,
                 "tool_tokens": float(len(ep.mask) - sum(ep.mask)), "env_error": float(error is not None),
                 "cached_tokens": float(ep.cached_tokens), "context_tokens": float(ep.context_tokens),
                 "env_timeout": float(timeout)}
        now = self.clock()
        return Finished(partial, 0.0 if error else ep.reward, stats, (ep.first_token or now, now), error)

    def _fail(self, ep: Episode, error: str, timeout: bool = False) -> Finished:
        ep.pending = None
        self.counters["env_errors"] += 1
        self.counters["env_timeouts"] += int(timeout)
        self.errors.append({"group_id": ep.rid.rpartition("/")[0], "sample_index": int(ep.rid.rpartition("/")[2]),
                            "error": error[:300]})
        return self._finish(ep, "abort", error, timeout)

    def truncate(self, rid: str) -> Finished:
        """End a trajectory the engine refused to continue (its context is full): "length"."""
        self.counters["limit_tokens"] += 1
        return self._finish(self.episodes[rid], "length")

    # ------------------------------------------------------------------ the worker's other paths
    def loss_mask(self, rid: str, n: int) -> np.ndarray | None:
        """The mask of an in-flight trajectory's first n response tokens (policy tokens the engine
        added since the episode's last record are 1)."""
        ep = self.episodes.get(rid)
        if ep is None:
            return None
        m = np.ones(n, np.float32)
        m[:min(n, len(ep.mask))] = ep.mask[:n]
        return m

    def snapshot(self, engine_partials) -> list[PartialTrajectory]:
        """A record of every live trajectory (module docstring): one the engine is decoding holds
        its current turn's tokens so far too (mask 1), one waiting on env.step its turns so far."""
        in_engine = {p.request_id: p for p in engine_partials}
        out = []
        for rid, ep in self.episodes.items():
            p = in_engine.get(rid)
            if p is None and ep.pending is None:
                continue
            gid, index = rid.rpartition("/")[0], int(rid.rpartition("/")[2])
            if p is not None:
                arrays = (p.response_tokens, p.raw_logp, p.logp, p.versions)
            else:
                arrays = (np.asarray(ep.tokens, np.int64), np.asarray(ep.raw_logp, np.float32),
                          np.asarray(ep.logp, np.float32), np.asarray(ep.versions, np.int64))
            mask = np.ones(len(arrays[0]), np.float32)
            mask[:len(ep.mask)] = ep.mask
            movable = ep.env_state is not None and not isinstance(ep.pending, _Failed)
            out.append(PartialTrajectory(group_id=gid, sample_index=index, rollout_id=self.rollout_id,
                                         prompt_tokens=ep.prompt_tokens, response_tokens=arrays[0],
                                         behaviour_logp=arrays[1], sample_logp=arrays[2], token_versions=arrays[3],
                                         loss_mask=mask,
                                         episode=episode_state(ep, "decode" if p is not None else "step")
                                         if movable else None))
        return out

    def resume(self, row, partial: PartialTrajectory, version: int) -> Request | None:
        """Continue a trajectory another rollout started (a `snapshot` record) on this one: its
        next request, or None when its env.step runs first. Raises EnvStateError (naming the
        env) when the record carries no usable state or the environment cannot restore it."""
        name = str(self.cfg.name)
        check_state(partial, name)
        env = self.make_env()
        restore_env(env, name, row, partial.episode["env"])
        ep = restored(partial, env, int(version), self.clock())
        rid = ep.rid
        self.episodes[rid] = ep
        if partial.episode["phase"] == "step":   # its step's result stayed behind: run it again on the same state
            ep.pending_since = self.clock()
            ep.pending = self.pool.submit(env.step, ep.last_text)
            return None
        return self._request(ep, partial)

    def drop(self, rids) -> None:
        """Forget episodes (their group was released or re-issued); a running step is abandoned."""
        for rid in rids:
            if self.episodes.pop(rid, None) is not None:
                self._ended.append(rid)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class _EnvFailure(Exception):
    pass


class _Failed:
    """A done 'future' that raises: an episode whose env.reset failed."""

    def __init__(self, error: str):
        self.error = error

    def done(self) -> bool:
        return True

    def result(self):
        raise _EnvFailure(self.error)


def _failed(error: str) -> _Failed:
    return _Failed(error)


__all__ = ["Episode", "Finished", "MultiTurn", "request_id"]
