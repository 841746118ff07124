"""Math-answer reward: is the completion's final answer equal to the reference?

Two backends, same contract (1.0 equal, 0.0 not or no answer found):
- "math_verify": Hugging Face Math-Verify (`pip install "math-verify[antlr4_13_2]"`), which
  extracts LaTeX / plain answers and compares them symbolically and numerically. Its timeouts use
  SIGALRM, which works only in the main thread: a run scores rewards on the main thread of its
  reward processes (rewards/pool.py), so they are on (`verify_timeout()`); called from another
  thread they are off and only the pool's reward.timeout_s bounds the call.
- "sympy": the final `\\boxed{...}` of the completion (else its last number), a small LaTeX to
  sympy translation, then string, numeric (relative 1e-6) or symbolic (`simplify(a - b) == 0`)
  equality. Model output never reaches `eval` unless it is made only of digits, operators,
  brackets and a short list of names (sqrt, pi, ...), and towers of powers are refused.
"auto" uses math_verify when it is installed, else sympy.
"""
from __future__ import annotations

import importlib.util
import re
import threading
from typing import Mapping

from laminar_jax.rewards.builtin import answer_of

MAX_EXPR_CHARS = 200
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_SAFE = re.compile(r"^[0-9a-zA-Z+\-*/().\s]*$")
_NAMES = {"sqrt", "pi", "E", "I", "oo"}


MATH_VERIFY_TIMEOUT_S = 5


def verify_timeout() -> int | None:
    """Math-Verify's parse / verify timeout here: on the main thread (a reward process), else off."""
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def math_verify_available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """Content of the {...} group opening at text[start], and the index after it."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}, or "\\boxed 5") in text."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = idx + (len("\\boxed") if text.startswith("\\boxed", idx) else len("\\fbox"))
    if rest < len(text) and text[rest] == " ":
        m = re.match(r" +([^\s$]+)", text[rest:])
        return m.group(1) if m else None
    got = _braced(text, rest)
    return None if got is None else got[0]


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: its last \\boxed{} content, else its last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text.replace("{,}", ","))
    return numbers[-1].strip() if numbers else None


def _replace_command(s: str, name: str, fmt) -> str:
    """Rewrite \\name{a}{b}... (fmt gets the arguments) for every occurrence, innermost first."""
    nargs = fmt.__code__.co_argcount
    while True:
        idx = s.rfind("\\" + name)
        if idx < 0:
            return s
        pos, args = idx + len(name) + 1, []
        for _ in range(nargs):
            got = _braced(s, pos)
            if got is None:  # \frac12 style: single-character arguments
                if pos >= len(s):
                    return s
                got = (s[pos], pos + 1)
            args.append(got[0])
            pos = got[1]
        s = s[:idx] + fmt(*args) + s[pos:]


def normalize(expr: str) -> str:
    """LaTeX-ish answer text -> a sympy-parsable string (best effort)."""
    s = expr.strip().strip("$").strip()
    s = re.sub(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}", r"\1", s)
    for cmd in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "^\\circ", "^{\\circ}",
                "\\%", "%", "\\$"):
        s = s.replace(cmd, "")
    s = s.replace("{,}", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    if "=" in s:  # "x = 3" -> "3"
        s = s.rsplit("=", 1)[1]
    s = s.strip().rstrip(".").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = _replace_command(s, "frac", lambda a, b: f"(({a})/({b}))")
    s = re.sub(r"\\sqrt\[([^\]]*)\]\{([^{}]*)\}", r"((\2)**(1/(\1)))", s)
    s = _replace_command(s, "sqrt", lambda a: f"sqrt({a})")
    for latex, plain in (("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("\\pi", "pi"),
                         ("\\infty", "oo"), ("^", "**"), ("{", "("), ("}", ")")):
        s = s.replace(latex, plain)
    return s.strip()


def _safe_parse(s: str):
    """A sympy expression for s, or None when s is not in the safe arithmetic subset."""
    if not s or len(s) > MAX_EXPR_CHARS or not _SAFE.match(s):
        return None
    if any(name not in _NAMES and len(name) > 1 for name in re.findall(r"[A-Za-z]+", s)):
        return None
    if re.search(r"[A-Za-z]\.|\.[A-Za-z]", s) or s.count("**") > 3:
        return None
    if any(len(m) > 3 for m in re.findall(r"\*\*\s*\(?\s*(\d+)", s)):  # exponents >= 1000
        return None
    if re.search(r"\*\*[^+\-*/]*\*\*", s.replace(" ", "")):  # a**b**c towers
        return None
    from sympy.parsing.sympy_parser import (implicit_multiplication_application, parse_expr,
                                            standard_transformations)
    try:
        return parse_expr(s, transformations=standard_transformations + (implicit_multiplication_application,))
    except Exception:  # sympy raises many kinds on malformed input
        return None


def sympy_equal(pred: str, gold: str) -> bool:
    """Equality of two answer strings: normalized text, then numeric, then symbolic."""
    a, b = normalize(pred), normalize(gold)
    if a == b and a:
        return True
    x, y = _safe_parse(a), _safe_parse(b)
    if x is None or y is None:
        return False
    import sympy

    try:
        if not x.free_symbols and not y.free_symbols:
            xv, yv = complex(sympy.N(x, 30)), complex(sympy.N(y, 30))
            return abs(xv - yv) <= 1e-6 * max(1.0, abs(yv))
        return sympy.simplify(x - y) == 0
    except Exception:  # non-numeric objects (e.g. zoo, relations) compare unequal
        return False


def math_equal(completion: str, gold: str, backend: str = "auto") -> bool:
    """Does the completion's final answer equal `gold` (which may itself hold a \\boxed{})?"""
    if backend not in ("auto", "math_verify", "sympy"):
        raise ValueError(f"math reward backend {backend!r}: expected 'auto', 'math_verify' or 'sympy'")
    if backend == "math_verify" or (backend == "auto" and math_verify_available()):
        from math_verify import parse, verify

        timeout = verify_timeout()
        gold_text = gold if ("\\boxed" in gold or "$" in gold) else f"${gold}$"
        gold_parsed = parse(gold_text, parsing_timeout=timeout)
        pred_parsed = parse(completion, parsing_timeout=timeout)
        return bool(gold_parsed) and bool(pred_parsed) and verify(gold_parsed, pred_parsed,
                                                                  timeout_seconds=timeout)
    pred = extract_answer(completion)
    gold_answer = last_boxed(gold)
    return pred is not None and sympy_equal(pred, gold if gold_answer is None else gold_answer)


def math_reward(prompt: str, completion: str, row: Mapping, *, answer_field: str = "answer",
                backend: str = "auto") -> float:
    """1.0 when the completion's final answer equals row[answer_field] (module docstring)."""
    return float(math_equal(completion, answer_of(row, answer_field), backend))
