"""The per-step tool metrics (laminar_jax/env/metrics.py): closed forms, fixed keys."""
import pytest

from laminar_jax.env.metrics import TOOL_METRIC_KEYS, tool_step_metrics


def test_tool_step_metrics_closed_forms_and_fixed_keys():
    stats = [dict(turns=2, tool_calls=1, correct_tool_calls=1, tool_errors=0, parse_errors=0, tool_tokens=11,
                  env_s=0.5, env_error=0, env_timeout=0, cached_tokens=30, context_tokens=40),
             dict(turns=3, tool_calls=2, correct_tool_calls=0, tool_errors=1, parse_errors=1, tool_tokens=20,
                  env_s=1.5, env_error=0, env_timeout=0, cached_tokens=0, context_tokens=60),
             dict(turns=1, tool_calls=0, correct_tool_calls=0, tool_errors=0, parse_errors=0, tool_tokens=0,
                  env_s=0.0, env_error=1, env_timeout=1),
             dict(turns=2, tool_calls=1, correct_tool_calls=0, tool_errors=0, parse_errors=0, tool_tokens=0,
                  env_s=2.0, env_error=1, env_timeout=0)]
    m = tool_step_metrics(stats, [40, 60, 10, 90])
    assert tuple(m) == TOOL_METRIC_KEYS
    assert m == pytest.approx({"tool/calls_per_traj": 4 / 4, "tool/correct_call_rate": 1 / 4,
                               "tool/error_obs_per_traj": 2 / 4, "tool/turns_per_traj": 8 / 4,
                               "tool/tool_token_frac": 31 / 200, "tool/env_errors": 1.0,
                               "tool/env_timeouts": 1.0, "tool/env_s_per_traj": 4.0 / 4,
                               "tool/kv_reuse_frac": 30 / 100})
    # single-turn trajectories (no turn stats) and an empty step: the same keys, all zero
    for empty in (tool_step_metrics([{}, {}], [5, 7]), tool_step_metrics([])):
        assert tuple(empty) == TOOL_METRIC_KEYS and not any(empty.values())
