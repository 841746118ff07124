"""The driver's view of reward failures across rollouts: console lines and the stop rule.

Each rollout's `RewardScorer.health()` travels in its stats (counts by kind, the last
reward.error_window outcomes, the first traceback of each kind). `RewardWatch.update(stats)`
returns console lines the first time a kind of failure appears (with its traceback); `check()`
then raises `RewardFailure` once the rollouts' windows hold at least error_window outcomes and

    sum(window errors) / sum(window calls) > reward.max_error_rate,

so a reward that is broken for most completions stops the run with one clear line instead of
training on zeros.
"""
from __future__ import annotations

from typing import Sequence

KINDS = ("raised", "non_finite", "not_a_number", "timeout", "crashed")


class RewardFailure(RuntimeError):
    """Too many reward failures: the run stops (the CLI prints the message on one line)."""


class RewardWatch:
    def __init__(self, *, max_error_rate: float, error_window: int):
        self.max_error_rate, self.error_window = max_error_rate, error_window
        self._shown: set[str] = set()
        self._last = None

    def update(self, stats: Sequence[dict]) -> list[str]:
        healths = [s["reward"] for s in stats if s.get("reward")]
        if not healths:
            return []
        fn = healths[0]["fn"]
        counts = {k: sum(h.get(k, 0) for h in healths) for k in ("calls", "errors", *KINDS)}
        lines = []
        for kind in KINDS:
            if counts[kind] and kind not in self._shown:
                self._shown.add(kind)
                first = next(h["first_errors"][kind] for h in healths if kind in h["first_errors"])
                lines.append(f"reward.fn {fn!r}: {counts[kind]} '{kind}' of {counts['calls']} completions so far "
                             f"(scored 0); the first:\n    " + first.rstrip().replace("\n", "\n    "))
        self._last = (fn, counts, sum(h["window_calls"] for h in healths),
                      sum(h["window_errors"] for h in healths))
        return lines

    def check(self) -> None:
        """Raise `RewardFailure` when the last `update`'s windows are past the rate."""
        if self._last is None:
            return
        fn, counts, calls, errors = self._last
        if calls >= self.error_window and errors / calls > self.max_error_rate:
            by_kind = ", ".join(f"{k} {counts[k]}" for k in KINDS if counts[k])
            raise RewardFailure(
                f"reward.fn {fn!r}: {errors} of the last {calls} completions failed ({errors / calls:.0%} > "
                f"reward.max_error_rate={self.max_error_rate:g}; {by_kind}); stopping the run - fix the reward "
                "(the first traceback is above, every failure is a reward_error event in events.jsonl)")
