"""Per-step tool metrics for the learner's metrics table (one row per learner step).

    tool_step_metrics(turn_stats) -> {key: float}   over the trajectories a step consumed

`turn_stats` are the per-trajectory counts `rollout.multiturn` records (Trajectory.turn_stats;
an empty mapping for a single-turn trajectory). The keys are `TOOL_METRIC_KEYS` whatever the
config (all 0 without an environment), so the table's columns never change with the options:

    tool/calls_per_traj       tool calls per trajectory (malformed ones included)
    tool/correct_call_rate    fraction of trajectories with at least one correct call (the task's
                              `is_correct_call`)
    tool/error_obs_per_traj   error observations per trajectory (parse errors + tool errors)
    tool/turns_per_traj       policy turns per trajectory
    tool/tool_token_frac      tool-output tokens (loss mask 0) / response tokens
    tool/env_errors           trajectories dropped because their env.step or reset raised
    tool/env_timeouts         trajectories dropped because env.step outlived env.step_timeout_s
    tool/env_s_per_traj       seconds per trajectory spent waiting on the environment
    tool/kv_reuse_frac        of the context tokens of turns after the first (prompt + response so
                              far), the fraction the engine did not prefill again because their K/V
                              were kept (env.kv_policy: keep); 0 with "release" or single-turn
"""
from __future__ import annotations

from typing import Mapping, Sequence

TOOL_METRIC_KEYS = ("tool/calls_per_traj", "tool/correct_call_rate", "tool/error_obs_per_traj", "tool/turns_per_traj",
                    "tool/tool_token_frac", "tool/env_errors", "tool/env_timeouts", "tool/env_s_per_traj", "tool/kv_reuse_frac")


def tool_step_metrics(turn_stats: Sequence[Mapping[str, float]],
                      response_tokens: Sequence[int] = ()) -> dict[str, float]:
    """The step's tool metrics (module docstring); `response_tokens`: each trajectory's response
    length (for tool/tool_token_frac; 0 when not given)."""
    n = max(len(turn_stats), 1)
    get = lambda key: [float(s.get(key, 0.0)) for s in turn_stats]  # noqa: E731
    total = float(sum(response_tokens))
    timeouts = sum(get("env_timeout"))
    context = sum(get("context_tokens"))
    return {"tool/calls_per_traj": sum(get("tool_calls")) / n,
            "tool/correct_call_rate": sum(c > 0 for c in get("correct_tool_calls")) / n,
            "tool/error_obs_per_traj": (sum(get("tool_errors")) + sum(get("parse_errors"))) / n,
            "tool/turns_per_traj": sum(get("turns")) / n,
            "tool/tool_token_frac": sum(get("tool_tokens")) / total if total > 0 else 0.0,
            "tool/env_errors": sum(get("env_error")) - timeouts,
            "tool/env_timeouts": timeouts,
            "tool/env_s_per_traj": sum(get("env_s")) / n,
            "tool/kv_reuse_frac": sum(get("cached_tokens")) / context if context > 0 else 0.0}
