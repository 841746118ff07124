"""Math answers: extraction and equivalence, with the sympy fallback and (if installed) Math-Verify."""
from __future__ import annotations

import pytest

from laminar_jax.rewards import extract_answer, last_boxed, math_equal, math_verify_available
from laminar_jax.rewards.math import normalize, sympy_equal

BACKENDS = ["sympy"] + (["math_verify"] if math_verify_available() else [])

CASES = [
    ("The answer is 42.", "42", True),
    ("so \\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{41}", "42", False),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("x = 3 so \\boxed{3}", "3", True),
    ("1, 2, then 7", "7", True),
    ("no answer here", "7", False),
    ("\\boxed{\\dfrac{3}{4}}", "\\boxed{0.75}", True),
    ("$1{,}000$", "1000", True),
    ("the answer is 1/2", "\\frac12", True),
    ("\\boxed{2^{10}}", "1024", True),
    ("\\boxed{-3}", "3", False),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", True),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("completion,gold,expected", CASES)
def test_math_equal_hand_cases(backend, completion, gold, expected):
    assert math_equal(completion, gold, backend) is expected


def test_extraction():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{2}{3}} c") == "\\frac{2}{3}"
    assert last_boxed("\\boxed 5$") == "5"
    assert last_boxed("\\fbox{x}") == "x"
    assert last_boxed("\\boxed{unclosed") is None
    assert extract_answer("first 3, then -4.5, finally 7/8 apples") == "7/8"
    assert extract_answer("nothing") is None
    assert normalize("\\left(\\frac{1}{2}\\right)^2") == "(((1)/(2)))**2"


def test_sympy_path_never_evaluates_unsafe_or_huge_input():
    assert not sympy_equal("__import__('os').system('true')", "0")
    assert not sympy_equal("9**9**9**9", "1")
    assert not sympy_equal("10**100000", "1")
    assert not math_equal("\\boxed{9^{9^{9^9}}}", "1", "sympy")
    assert sympy_equal("2.0000000001", "2")


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend 'nope'"):
        math_equal("1", "1", "nope")
