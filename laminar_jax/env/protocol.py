"""The environment protocol a multi-turn rollout drives.

    messages = env.reset(row)                 chat messages that open the episode
    obs, reward, done, info = env.step(text)  the policy's turn (decoded text) -> the next
                                              observation (a tool result, or None when done),
                                              a reward, and whether the episode is over

One environment object serves one trajectory (the rollout builds a fresh one per sample), so it
may keep state between steps. `info` carries counts the rollout sums per trajectory and logs
(keys of `COUNT_KEYS` when present: tool_calls, tool_errors, parse_errors, correct_tool_calls).
"""
from __future__ import annotations

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
