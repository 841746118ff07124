"""Resolve `reward.fn` to a callable and score completions, reporting every failure.

`reward.fn` is a built-in name (`BUILTIN_REWARDS`) or "package.module:function", a user function
called as `fn(prompt, completion, row) -> float` with the dataset row. `resolve_reward` imports
it and checks it can take those three arguments; the runtime calls it before starting workers,
so a typo fails at once with a message naming the spec (a `ConfigError`).

`score` never lets a bad reward through and never turns it into 0 silently: an exception, NaN,
inf, or a value that is not a real number comes back as a `RewardError` record (function name,
prompt id, exception text); the caller decides what to do (the runtime logs it as an event).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from laminar_jax.config_loader import ConfigError
from laminar_jax.rewards.builtin import check_tags, exact_match_reward, format_reward, task_reward
from laminar_jax.rewards.math import math_reward

# name -> (function, options it takes from the config)
BUILTIN_REWARDS: dict[str, tuple[Callable[..., float], tuple[str, ...]]] = {
    "exact_match": (exact_match_reward, ("answer_field",)),
    "math": (math_reward, ("answer_field", "backend")),
    "format": (format_reward, ("tags",)),
    "task": (task_reward, ()),
}


class RewardSpecError(ConfigError):
    """`reward.fn` does not name a usable function."""


@dataclass(frozen=True)
class RewardError:
    """A reward that failed on one completion. kind: "raised" | "non_finite" | "not_a_number"."""

    fn: str
    prompt_id: str
    kind: str
    error: str
    group_id: str = ""
    sample_index: int = -1

    def to_event(self) -> dict:
        """Fields for `RunWriter.log_event("reward_error", **fields)`."""
        return asdict(self)


@dataclass(frozen=True)
class RewardResult:
    """value is the reward, or None with `error` set."""

    value: float | None
    error: RewardError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _import_user_fn(spec: str) -> Callable:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail to import in any way
        raise RewardSpecError(f"reward.fn {spec!r}: cannot import module {module_name!r} "
                              f"({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardSpecError(f"reward.fn {spec!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
                              f"has no attribute {attr!r}")
    if not callable(fn):
        raise RewardSpecError(f"reward.fn {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("prompt", "completion", {})
    except TypeError as e:
        raise RewardSpecError(f"reward.fn {spec!r}: must accept (prompt, completion, row); {e}") from None
    except ValueError:  # builtins without a signature: accept and let score() report failures
        pass
    return fn


class Reward:
    """A resolved reward: `reward(prompt, completion, row) -> float`.

    Pickles as its spec and options and re-resolves on load, so a Ray worker imports the user
    module itself (it must be importable there too).
    """

    def __init__(self, fn: str, *, answer_field: str = "answer", format_tags: Sequence[str] = ("think",),
                 math_backend: str = "auto"):
        self.name = fn
        self.options = dict(answer_field=answer_field, format_tags=tuple(format_tags), math_backend=math_backend)
        self._fn = self._resolve()

    def _resolve(self) -> Callable:
        spec = self.name
        if not isinstance(spec, str) or not spec.strip():
            raise RewardSpecError(f"reward.fn: expected a built-in name or 'package.module:function', got {spec!r}")
        if ":" in spec:
            return _import_user_fn(spec)
        if spec not in BUILTIN_REWARDS:
            raise RewardSpecError(f"reward.fn {spec!r}: not a built-in reward ({', '.join(sorted(BUILTIN_REWARDS))})"
                                  f" and not an import path 'package.module:function'")
        fn, takes = BUILTIN_REWARDS[spec]
        values = dict(answer_field=self.options["answer_field"], backend=self.options["math_backend"])
        if "tags" in takes:
            try:
                values["tags"] = check_tags(self.options["format_tags"])
            except ValueError as e:
                raise RewardSpecError(str(e)) from None
        if "backend" in takes and values["backend"] not in ("auto", "math_verify", "sympy"):
            raise RewardSpecError(f"reward.math_backend {values['backend']!r}: expected auto, math_verify or sympy")
        return functools.partial(fn, **{k: values[k] for k in takes})

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> Any:
        return self._fn(prompt, completion, row)

    def __getstate__(self) -> dict:
        return {"name": self.name, "options": self.options}

    def __setstate__(self, state: dict) -> None:
        self.name, self.options = state["name"], state["options"]
        self._fn = self._resolve()

    def __repr__(self) -> str:
        return f"Reward({self.name!r})"


def resolve_reward(spec, *, answer_field: str = "answer") -> Reward:
    """A `Reward` from a `RewardConfig` or a spec string; `RewardSpecError` when unusable."""
    if isinstance(spec, str):
        return Reward(spec, answer_field=answer_field)
    return Reward(spec.fn, answer_field=answer_field, format_tags=getattr(spec, "format_tags", ("think",)),
                  math_backend=getattr(spec, "math_backend", "auto"))


def check_value(value: Any) -> tuple[float | None, str | None, str | None]:
    """(reward, kind, message): a real finite number, or why not."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None, "not_a_number", f"returned {type(value).__name__} {value!r:.80}, expected a float"
    value = float(value)
    if not math.isfinite(value):
        return None, "non_finite", f"returned {value}, expected a finite float"
    return value, None, None


def score(reward: Callable, *, prompt: str, completion: str, row: Mapping[str, Any], prompt_id: str,
          group_id: str = "", sample_index: int = -1, name: str | None = None) -> RewardResult:
    """Call the reward on one completion; failures come back as a `RewardError`, never raise."""
    name = name or getattr(reward, "name", getattr(reward, "__name__", repr(reward)))
    try:
        raw = reward(prompt, completion, row)
    except Exception as e:  # any failure of user code is reported, not propagated
        kind, message, value = "raised", f"{type(e).__name__}: {e}", None
    else:
        value, kind, message = check_value(raw)
    if kind is None:
        return RewardResult(value)
    return RewardResult(None, RewardError(name, prompt_id, kind, message, group_id, sample_index))


class RewardScorer:
    """`score` with running counts (calls, errors by kind), for a rollout worker's stats."""

    def __init__(self, reward: Callable, name: str | None = None):
        self.reward = reward
        self.name = name or getattr(reward, "name", getattr(reward, "__name__", repr(reward)))
        self._counts = dict(calls=0, errors=0, raised=0, non_finite=0, not_a_number=0)

    def score(self, *, prompt: str, completion: str, row: Mapping[str, Any], prompt_id: str,
              group_id: str = "", sample_index: int = -1) -> RewardResult:
        result = score(self.reward, prompt=prompt, completion=completion, row=row, prompt_id=prompt_id,
                       group_id=group_id, sample_index=sample_index, name=self.name)
        self._counts["calls"] += 1
        if result.error is not None:
            self._counts["errors"] += 1
            self._counts[result.error.kind] += 1
        return result

    def score_group(self, group, completions: Sequence[str]) -> list[RewardResult]:
        """Score the completions of a `PromptGroup`, sample i being completions[i]."""
        return [self.score(prompt=group.prompt, completion=c, row=group.row, prompt_id=group.prompt_id,
                           group_id=group.group_id, sample_index=i) for i, c in enumerate(completions)]

    def counts(self) -> dict[str, int]:
        return dict(self._counts)
