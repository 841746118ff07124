"""`code_exec`: run the completion's program in the sandbox against the row's tests.

The program is the last fenced block of the completion (```python ... ``` or ``` ... ```); a
completion without one scores 0. The tests are row[answer_field], either

- a list of {"input": str, "output": str}: the program runs once per case with the input on
  stdin; reward = the fraction of cases whose stdout equals the output (surrounding whitespace
  ignored); or
- a string of Python (asserts): it runs after the program; reward 1.0 when it exits 0, else 0.

Each run is a `sandbox.run_code` call (no network, rlimits, own temp folder) with
reward.code_timeout_s and reward.code_memory_mb. A program that loops, forks, allocates or
connects is refused by the sandbox and simply fails its test; a sandbox that cannot isolate
(status "unavailable") raises, so the reward is reported as failed instead of running the code
without isolation.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from laminar_jax.rewards.builtin import answer_of
from laminar_jax.rewards.sandbox import run_code

_BLOCK = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.S | re.I)


def last_code_block(completion: str) -> str | None:
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else None


def _run(code: str, stdin: str, sandbox: Mapping[str, Any]):
    result = run_code(code, stdin=stdin, timeout_s=float(sandbox.get("timeout_s", 5.0)),
                      memory_mb=int(sandbox.get("memory_mb", 512)))
    if result.status == "unavailable":
        raise RuntimeError(f"code_exec: the sandbox cannot isolate this program: {result.detail}")
    return result


def code_exec_reward(prompt: str, completion: str, row: Mapping, *, answer_field: str = "answer",
                     sandbox: Mapping[str, Any] | None = None) -> float:
    sandbox = sandbox or {}
    tests = row.get(answer_field) if isinstance(row, Mapping) else None
    if tests is None:
        answer_of(row, answer_field)  # raises, naming the field
    code = last_code_block(completion)
    if code is None:
        return 0.0
    if isinstance(tests, str):
        return float(_run(code + "\n\n" + tests + "\n", "", sandbox).ok)
    if not isinstance(tests, (list, tuple)) or not tests or not all(
            isinstance(t, Mapping) and "input" in t and "output" in t for t in tests):
        raise ValueError(f"code_exec: row field {answer_field!r} must be a string of asserts or a non-empty list "
                         f"of {{'input', 'output'}} cases, got {str(tests)[:80]!r}")
    passed = 0
    for case in tests:
        result = _run(code, str(case["input"]), sandbox)
        passed += result.ok and result.stdout.strip() == str(case["output"]).strip()
    return passed / len(tests)
