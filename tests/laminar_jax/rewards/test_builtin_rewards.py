"""Built-in rewards on hand cases: exact match, format tags, missing answers."""
from __future__ import annotations

import pytest

from laminar_jax.rewards import exact_match, has_tags, resolve_reward, score


@pytest.mark.parametrize("completion,answer,expected", [
    ("42", "42", 1.0), ("  42\n", "42", 1.0), ("42 ", " 42", 1.0),
    ("41", "42", 0.0), ("42.", "42", 0.0), ("", "42", 0.0), ("4 2", "42", 0.0), ("Paris", "paris", 0.0),
])
def test_exact_match(completion, answer, expected):
    assert exact_match(completion, answer) == expected


@pytest.mark.parametrize("completion,tags,expected", [
    ("<think>hmm</think>42", ("think",), 1.0),
    ("<think> </think>42", ("think",), 0.0),                       # empty inside
    ("<think>a</think><think>b</think>", ("think",), 0.0),          # twice
    ("</think>a<think>", ("think",), 0.0),                          # closed before opened
    ("no tags", ("think",), 0.0),
    ("<think>x</think> <answer>4</answer>", ("think", "answer"), 1.0),
    ("<answer>4</answer><think>x</think>", ("think", "answer"), 0.0),  # wrong order
    ("<think>x<answer>4</answer></think>", ("think", "answer"), 0.0),  # nested, not in sequence
])
def test_has_tags(completion, tags, expected):
    assert has_tags(completion, tags) == expected


def test_builtins_read_the_configured_answer_field():
    row = {"solution": "7", "answer": "8"}
    assert resolve_reward("exact_match", answer_field="solution")("p", "7", row) == 1.0
    assert resolve_reward("exact_match")("p", "7", row) == 0.0
    assert resolve_reward("math", answer_field="solution")("p", "so \\boxed{7}", row) == 1.0


def test_missing_answer_is_an_error_record_not_a_zero():
    result = score(resolve_reward("exact_match"), prompt="p", completion="7", row={"q": 1}, prompt_id="p3")
    assert result.value is None and result.error.kind == "raised"
    assert "no answer in field 'answer' (fields: q)" in result.error.error
    assert (result.error.fn, result.error.prompt_id) == ("exact_match", "p3")


def test_format_reward_uses_configured_tags():
    from laminar_jax.config import RewardConfig

    reward = resolve_reward(RewardConfig(fn="format", format_tags=("think", "answer")))
    assert reward("p", "<think>a</think><answer>b</answer>", {}) == 1.0
    assert reward("p", "<think>a</think>", {}) == 0.0
    with pytest.raises(ValueError, match="format_tags"):
        RewardConfig(fn="format", format_tags=("a b",))
