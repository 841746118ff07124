"""Rule-based rewards: exact match, required format tags, a built-in task's own rule.

Every reward here has the signature of a user reward, `fn(prompt, completion, row) -> float`,
plus keyword options the registry binds from the config (`answer_field`, `tags`). A row without
the answer is an error (raised, so the caller records a `RewardError`), never a silent 0.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from laminar_jax.data.tasks import task_score


def answer_of(row: Mapping[str, Any], answer_field: str) -> str:
    """The reference answer of `row` as text; ValueError naming the field when it is missing."""
    if not isinstance(row, Mapping) or row.get(answer_field) is None:
        fields = ", ".join(map(str, row)) if isinstance(row, Mapping) else type(row).__name__
        raise ValueError(f"row has no answer in field {answer_field!r} (fields: {fields})")
    return str(row[answer_field])


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion equals the answer, surrounding whitespace ignored, else 0.0."""
    return float(completion.strip() == answer.strip())


def has_tags(completion: str, tags: Sequence[str] = ("think",)) -> float:
    """1.0 when each `<tag>...</tag>` occurs exactly once, in the order given, with non-blank text
    inside; else 0.0. E.g. tags ("think", "answer") accepts "<think>..</think> <answer>4</answer>".
    """
    pos = 0
    for tag in tags:
        open_, close = f"<{tag}>", f"</{tag}>"
        if completion.count(open_) != 1 or completion.count(close) != 1:
            return 0.0
        start, end = completion.find(open_), completion.find(close)
        if start < pos or end < start or not completion[start + len(open_):end].strip():
            return 0.0
        pos = end + len(close)
    return 1.0


def exact_match_reward(prompt: str, completion: str, row: Mapping, *, answer_field: str = "answer") -> float:
    return exact_match(completion, answer_of(row, answer_field))


def format_reward(prompt: str, completion: str, row: Mapping, *, tags: Sequence[str] = ("think",)) -> float:
    return has_tags(completion, tags)


def task_reward(prompt: str, completion: str, row: Mapping) -> float:
    """The built-in task's own scoring rule (e.g. countdown's partial credit), by `row["task"]`."""
    return task_score(completion, row)


_TAG = re.compile(r"^[A-Za-z_][\w\-]*$")


def check_tags(tags: Sequence[str]) -> tuple[str, ...]:
    bad = [t for t in tags if not isinstance(t, str) or not _TAG.match(t)]
    if bad or not tags:
        raise ValueError(f"reward.format_tags: expected non-empty tag names like 'think', got {list(tags)!r}")
    return tuple(tags)
