"""The environment protocol a multi-turn rollout drives.

    messages = env.reset(row)                 chat messages that open the episode
    obs, reward, done, info = env.step(text)  the policy's turn (decoded text) -> the next
                                              observation (a tool result, or None when done),
                                              a reward, and whether the episode is over

One environment object serves one trajectory (the rollout builds a fresh one per sample), so it
may keep state between steps. `info` carries counts the rollout sums per trajectory and logs
(keys of `COUNT_KEYS` when present: tool_calls, tool_errors, parse_errors, correct_tool_calls).

Optional, so that a trajectory can move between rollouts between its turns (repack, failover):

    state = env.snapshot()        the environment's state between two steps, as plain JSON data
    env.restore(row, state)       on a fresh environment, in place of reset(row): the same state

The state travels in the partial-response pool and the learner checkpoint as JSON, never
pickled, so it holds only dicts, lists, strings, numbers, booleans and None (`snapshot_state`
checks it). An environment without the two methods works as before; its trajectories just stay
on the rollout that started them.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, NamedTuple, Protocol, runtime_checkable

COUNT_KEYS = ("tool_calls", "tool_errors", "parse_errors", "correct_tool_calls")


class StepResult(NamedTuple):
    observation: str | None
    reward: float
    done: bool
    info: Mapping[str, Any]


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: Mapping[str, Any]) -> list[dict]: ...

    def step(self, action_text: str) -> StepResult | tuple: ...


def as_step_result(value: Any) -> StepResult:
    """A step's return value checked: a 4-tuple with a finite reward and a mapping of info."""
    try:
        obs, reward, done, info = value
    except (TypeError, ValueError):
        raise ValueError(f"env.step must return (observation, reward, done, info), got {value!r:.200}") from None
    reward = float(reward)
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise ValueError(f"env.step returned a non-finite reward {reward}")
    if obs is not None and not isinstance(obs, str):
        raise ValueError(f"env.step observation must be a string or None, got {type(obs).__name__}")
    return StepResult(obs, reward, bool(done), dict(info or {}))


class EnvStateError(ValueError):
    """An environment's snapshot cannot be taken or restored (the message names the env)."""


def can_snapshot(env: Any) -> bool:
    return callable(getattr(env, "snapshot", None)) and callable(getattr(env, "restore", None))


def snapshot_state(env: Any, name: str) -> dict:
    """`env.snapshot()` checked to be JSON data; returned as its JSON round trip (a copy that
    later steps cannot change). Raises EnvStateError naming env `name`."""
    try:
        state = env.snapshot()
    except Exception as e:  # noqa: BLE001 - the user's environment
        raise EnvStateError(f"env {name!r}: snapshot() raised {type(e).__name__}: {e}") from None
    if not isinstance(state, Mapping):
        raise EnvStateError(f"env {name!r}: snapshot() must return a mapping, got {type(state).__name__}")
    try:
        text = json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise EnvStateError(f"env {name!r}: snapshot() is not JSON data ({e})") from None
    return json.loads(text)


def restore_env(env: Any, name: str, row: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """`env.restore(row, state)`; a failure raises EnvStateError naming env `name`."""
    if not can_snapshot(env):
        raise EnvStateError(f"env {name!r}: {type(env).__name__} has no snapshot() / restore(row, state)")
    try:
        env.restore(row, json.loads(json.dumps(state)))
    except Exception as e:  # noqa: BLE001 - the user's environment
        raise EnvStateError(f"env {name!r}: restore() of a snapshot raised {type(e).__name__}: {e}") from None
