"""reward.fn resolution (built-ins, user import paths) and failure reporting."""
from __future__ import annotations

import math
import pickle
import sys
import textwrap

import numpy as np
import pytest

from laminar_jax.config import ConfigError, RewardConfig
from laminar_jax.data import PromptGroup
from laminar_jax.rewards import (BUILTIN_REWARDS, RewardError, RewardScorer, RewardSpecError, resolve_reward,
                                 score)

USER_MODULE = """
import math

calls = []

def score(prompt, completion, row):
    calls.append((prompt, completion, dict(row)))
    return float(len(completion) == row["n"]) + 0.5 * completion.startswith(prompt)

def nan_reward(prompt, completion, row):
    return math.nan

def inf_reward(prompt, completion, row):
    return -math.inf

def boom(prompt, completion, row):
    raise RuntimeError("grader crashed on " + completion)

def text_reward(prompt, completion, row):
    return "1.0"

def bool_reward(prompt, completion, row):
    return True

def none_reward(prompt, completion, row):
    return None

def numpy_reward(prompt, completion, row):
    import numpy as np
    return np.float32(0.25)

def two_args(prompt, completion):
    return 1.0

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    pkg = tmp_path / "my_rewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "grading.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / "broken_reward_mod.py").write_text("raise ImportError('needs a GPU grader')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_pkg.grading"
    for name in ("my_rewards_pkg", "my_rewards_pkg.grading", "broken_reward_mod"):
        sys.modules.pop(name, None)


def test_user_reward_by_import_path_gets_prompt_completion_and_row(user_module):
    reward = resolve_reward(RewardConfig(fn=f"{user_module}:score"))
    assert reward("ab", "abc", {"n": 3}) == 1.5
    assert reward("x", "abc", {"n": 2}) == 0.0
    assert sys.modules[user_module].calls[0] == ("ab", "abc", {"n": 3})
    again = pickle.loads(pickle.dumps(reward))  # ships to Ray workers by spec
    assert again.name == f"{user_module}:score" and again("ab", "abc", {"n": 3}) == 1.5


@pytest.mark.parametrize("spec,message", [
    ("no_such_pkg_xyz.rewards:score", "cannot import module 'no_such_pkg_xyz.rewards' (ModuleNotFoundError"),
    ("broken_reward_mod:score", "cannot import module 'broken_reward_mod' (ImportError: needs a GPU grader)"),
    ("{mod}:missing", "has no attribute 'missing'"),
    ("{mod}:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a function"),
    ("{mod}:two_args", "must accept (prompt, completion, row)"),
    ("exact_matc", "not a built-in reward (code_exec, exact_match, format, math, task)"),
])
def test_unresolvable_specs_fail_early_with_the_spec_named(user_module, spec, message):
    spec = spec.format(mod=user_module)
    with pytest.raises(RewardSpecError) as info:
        resolve_reward(spec)
    assert f"reward.fn {spec!r}" in str(info.value) and message in str(info.value)
    assert isinstance(info.value, ConfigError)


@pytest.mark.parametrize("fn,kind,text", [
    ("nan_reward", "non_finite", "returned nan, expected a finite float"),
    ("inf_reward", "non_finite", "returned -inf"),
    ("boom", "raised", "RuntimeError: grader crashed on out"),
    ("text_reward", "not_a_number", "returned str '1.0', expected a float"),
    ("bool_reward", "not_a_number", "returned bool True"),
    ("none_reward", "not_a_number", "returned NoneType None"),
])
def test_bad_rewards_are_reported_with_prompt_and_function(user_module, fn, kind, text):
    spec = f"{user_module}:{fn}"
    result = score(resolve_reward(spec), prompt="p", completion="out", row={}, prompt_id="q9",
                   group_id="e0-1", sample_index=3)
    assert result.value is None and not result.ok
    err = result.error
    assert isinstance(err, RewardError)
    assert (err.fn, err.prompt_id, err.kind, err.group_id, err.sample_index) == (spec, "q9", kind, "e0-1", 3)
    assert text in err.error
    assert err.to_event()["error"] == err.error


def test_numpy_and_int_values_are_accepted(user_module):
    result = score(resolve_reward(f"{user_module}:numpy_reward"), prompt="", completion="", row={}, prompt_id="x")
    assert result.ok and result.value == 0.25 and type(result.value) is float
    assert score(lambda p, c, r: 1, prompt="", completion="", row={}, prompt_id="x").value == 1.0


def test_scorer_counts_every_outcome():
    calls = iter([1.0, math.nan, "bad", 0.5])

    def flaky(prompt, completion, row):
        return next(calls)

    scorer = RewardScorer(flaky)
    group = PromptGroup("e0-0", "p0", "2:", np.array([1]), "2 1", {"answer": "2 1"}, 4, 0, 0)
    results = scorer.score_group(group, ["a", "b", "c", "d"])
    assert [r.value for r in results] == [1.0, None, None, 0.5]
    assert [r.error.sample_index for r in results if r.error] == [1, 2]
    assert scorer.counts() == dict(calls=4, errors=2, raised=0, non_finite=1, not_a_number=1, timeout=0, crashed=0)


def test_builtin_names_and_spec_errors():
    assert set(BUILTIN_REWARDS) == {"exact_match", "math", "format", "task", "code_exec"}
    for name in BUILTIN_REWARDS:
        assert resolve_reward(name).name == name
    with pytest.raises(RewardSpecError, match="math_backend 'x'"):
        from laminar_jax.rewards.registry import Reward
        Reward("math", math_backend="x")
