"""Resolve `reward.fn` to a callable and score completions, reporting every failure.

`reward.fn` is a built-in name (`BUILTIN_REWARDS`) or "package.module:function", a user function
called as `fn(prompt, completion, row) -> float` with the dataset row. `resolve_reward` imports
it and checks it can take those three arguments; the runtime calls it before starting workers,
so a typo fails at once with a message naming the spec (a `ConfigError`).

`score` never lets a bad reward through and never turns it into 0 silently: an exception, NaN,
inf, or a value that is not a real number comes back as a `RewardError` record (function name,
prompt id, exception text); the caller decides what to do (the runtime logs it as an event).

`RewardScorer` is what a rollout holds: for a resolved `Reward` it scores in a `RewardPool`
(worker processes with reward.timeout_s, cpu_s and memory_mb; `submit_group` returns at once, so
decoding goes on while a group is scored), adding the kinds "timeout" and "crashed"; it counts
every outcome by kind, keeps the last `error_window` outcomes for the run's error-rate check and
the first traceback of each kind (`health()`, read by `rewards.health.RewardWatch` on the driver).
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import importlib
import inspect
import math
import threading
import traceback as tb
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from laminar_jax.config_loader import ConfigError
from laminar_jax.rewards.builtin import check_tags, exact_match_reward, format_reward, task_reward
from laminar_jax.rewards.code import code_exec_reward
from laminar_jax.rewards.math import math_reward

# name -> (function, options it takes from the config)
BUILTIN_REWARDS: dict[str, tuple[Callable[..., float], tuple[str, ...]]] = {
    "exact_match": (exact_match_reward, ("answer_field",)),
    "math": (math_reward, ("answer_field", "backend")),
    "format": (format_reward, ("tags",)),
    "task": (task_reward, ()),
    "code_exec": (code_exec_reward, ("answer_field", "sandbox")),
}
ERROR_KINDS = ("raised", "non_finite", "not_a_number", "timeout", "crashed")


class RewardSpecError(ConfigError):
    """`reward.fn` does not name a usable function."""


@dataclass(frozen=True)
class RewardError:
    """A reward that failed on one completion. kind: one of `ERROR_KINDS`."""

    fn: str
    prompt_id: str
    kind: str
    error: str
    group_id: str = ""
    sample_index: int = -1
    traceback: str = ""

    def to_event(self) -> dict:
        """Fields for `RunWriter.log_event("reward_error", **fields)`; the traceback stays out (one
        per failing completion would flood events.jsonl; the first of each kind reaches the console)."""
        fields = asdict(self)
        fields.pop("traceback")
        return fields


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
                 math_backend: str = "auto", pool: Mapping[str, Any] | None = None,
                 sandbox: Mapping[str, Any] | None = None):
        self.name = fn
        self.options = dict(answer_field=answer_field, format_tags=tuple(format_tags), math_backend=math_backend,
                            pool=dict(pool or {}), sandbox=dict(sandbox or {}))
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
        values = dict(answer_field=self.options["answer_field"], backend=self.options["math_backend"],
                      sandbox=self.options.get("sandbox", {}))
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


# built-in rewards that are linear string rules over our own code: with `reward.workers` null
# they are scored on the rollout's thread. A process per call cost each rollout two process
# starts inside the first step and a pickle round trip per completion, to guard code that
# cannot hang or blow up.
IN_PROCESS_BUILTINS = frozenset({"exact_match", "format", "task"})
DEFAULT_WORKERS = 2


def pool_workers(fn: str, workers: int | None) -> int:
    """Reward processes per rollout for `reward.fn` = fn: `workers`, or when null 0 for
    IN_PROCESS_BUILTINS and DEFAULT_WORKERS for the rest."""
    if workers is not None:
        return int(workers)
    return 0 if fn in IN_PROCESS_BUILTINS else DEFAULT_WORKERS


def resolve_reward(spec, *, answer_field: str = "answer") -> Reward:
    """A `Reward` from a `RewardConfig` or a spec string; `RewardSpecError` when unusable."""
    if isinstance(spec, str):
        return Reward(spec, answer_field=answer_field)
    pool = {k: getattr(spec, k) for k in ("workers", "timeout_s", "cpu_s", "memory_mb", "error_window")
            if hasattr(spec, k)}
    sandbox = {k.removeprefix("code_"): getattr(spec, k) for k in ("code_timeout_s", "code_memory_mb")
               if hasattr(spec, k)}
    return Reward(spec.fn, answer_field=answer_field, format_tags=getattr(spec, "format_tags", ("think",)),
                  math_backend=getattr(spec, "math_backend", "auto"), pool=pool, sandbox=sandbox)


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
    trace = ""
    try:
        raw = reward(prompt, completion, row)
    except Exception as e:  # any failure of user code is reported, not propagated
        kind, message, value, trace = "raised", f"{type(e).__name__}: {e}", None, tb.format_exc()[-4000:]
    else:
        value, kind, message = check_value(raw)
    if kind is None:
        return RewardResult(value)
    return RewardResult(None, RewardError(name, prompt_id, kind, message, group_id, sample_index, trace))


class PendingScores:
    """The rewards of one group being computed; `done()` polls, `results()` collects (once)."""

    def __init__(self, scorer: "RewardScorer", group, futures: list):
        self._scorer, self._group, self._futures, self._results = scorer, group, futures, None

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self, timeout_s: float) -> bool:
        """Block until every reward is in or `timeout_s` passed; `done()`."""
        concurrent.futures.wait(self._futures, timeout=timeout_s)
        return self.done()

    def results(self) -> list[RewardResult]:
        if self._results is None:
            self._results = [self._scorer._record(self._group, i, f.result()) for i, f in enumerate(self._futures)]
        return self._results


class RewardScorer:
    """`score` with running counts by kind, an error window and first tracebacks; scores a
    resolved `Reward` in a `RewardPool` (module docstring), any other callable in-process.

    Picklable (the pool is started in the process that scores: a Ray rollout actor).
    """

    def __init__(self, reward: Callable, name: str | None = None):
        self.reward = reward
        self.name = name or getattr(reward, "name", getattr(reward, "__name__", repr(reward)))
        options = getattr(reward, "options", {}) if isinstance(reward, Reward) else {}
        self.pool_options = dict(options.get("pool", {}))
        # reward processes: none for a plain callable (tests), else per `pool_workers`
        self.workers = pool_workers(reward.name, self.pool_options.get("workers")) if isinstance(reward, Reward) else 0
        self._setup()

    def _setup(self) -> None:
        self._counts = dict(calls=0, errors=0, **{k: 0 for k in ERROR_KINDS})
        self._window = collections.deque(maxlen=int(self.pool_options.get("error_window", 64)))
        self._first: dict[str, str] = {}
        self._lock, self._pool = threading.Lock(), None

    def __getstate__(self) -> dict:
        return {"reward": self.reward, "name": self.name, "pool_options": self.pool_options, "workers": self.workers}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

    # ------------------------------------------------------------------ scoring
    def _futures(self, group, completions: Sequence[str]) -> list:
        if self.workers < 1:
            out = []
            for c in completions:  # in-process (plain callables: tests, or workers=0)
                f = concurrent.futures.Future()
                f.set_result(score(self.reward, prompt=group.prompt, completion=c, row=group.row,
                                   prompt_id=group.prompt_id, group_id=group.group_id, name=self.name))
                out.append(f)
            return out
        if self._pool is None:
            from laminar_jax.rewards.pool import RewardPool
            o = self.pool_options
            self._pool = RewardPool(self.reward, workers=self.workers,
                                    timeout_s=o.get("timeout_s", 10.0), cpu_s=o.get("cpu_s", 10.0),
                                    memory_mb=int(o.get("memory_mb", 4096)))
        return [self._pool.submit(group.prompt, c, group.row) for c in completions]

    def _record(self, group, index: int, got) -> RewardResult:
        if not isinstance(got, RewardResult):  # a pool Outcome
            got = RewardResult(got.value) if got.kind is None else RewardResult(None, RewardError(
                self.name, group.prompt_id, got.kind, got.message, group.group_id, index, got.traceback))
        elif got.error is not None:
            got = RewardResult(None, RewardError(**{**asdict(got.error), "sample_index": index}))
        with self._lock:
            self._counts["calls"] += 1
            self._window.append(got.error is not None)
            if got.error is not None:
                self._counts["errors"] += 1
                self._counts[got.error.kind] += 1
                self._first.setdefault(got.error.kind, got.error.traceback or got.error.error)
        return got

    def submit_group(self, group, completions: Sequence[str]) -> PendingScores:
        """Start scoring the completions of a `PromptGroup` (sample i = completions[i])."""
        return PendingScores(self, group, self._futures(group, completions))

    def score_group(self, group, completions: Sequence[str]) -> list[RewardResult]:
        """Score the completions of a `PromptGroup`, sample i being completions[i] (waits)."""
        return self.submit_group(group, completions).results()

    def score(self, *, prompt: str, completion: str, row: Mapping[str, Any], prompt_id: str,
              group_id: str = "", sample_index: int = -1) -> RewardResult:
        """One completion, in this process."""
        result = score(self.reward, prompt=prompt, completion=completion, row=row, prompt_id=prompt_id,
                       group_id=group_id, sample_index=sample_index, name=self.name)
        with self._lock:
            self._counts["calls"] += 1
            self._window.append(result.error is not None)
            if result.error is not None:
                self._counts["errors"] += 1
                self._counts[result.error.kind] += 1
                self._first.setdefault(result.error.kind, result.error.traceback or result.error.error)
        return result

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def health(self) -> dict:
        """Counts, the error window (calls, errors) and the first traceback of each error kind."""
        with self._lock:
            return {"fn": self.name, **self._counts, "window_calls": len(self._window),
                    "window_errors": int(sum(self._window)), "first_errors": dict(self._first)}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
