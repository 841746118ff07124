"""End to end, multi-turn tool calling (configs/tool.yaml, real Ray, JAX engines and learner, the
lookup environment): from the noisy warm-up (half the demonstrations guess without the tool), RL
raises both the reward and the rate of correct tool calls; tool outputs are in the trajectories
with loss mask 0, every trajectory keeps one weight version across its turns, and the metrics
table carries the per-step tool metrics (laminar_jax/env/metrics.py)."""
import numpy as np
import pytest

from laminar_jax.analysis import load_run
from laminar_jax.config import load_config
from laminar_jax.env.metrics import TOOL_METRIC_KEYS
from laminar_jax.runtime import driver
from tests.laminar_jax.runtime.runtime_fixtures import CACHE

OVERRIDES = ["run.steps=16"]   # configs/tool.yaml (20 steps) cut short: the rise shows by step ~10


def split_rates(traj):
    first, last = (traj[traj.learner_version < 4], traj[traj.learner_version >= traj.learner_version.max() - 3])
    rate = lambda t: float((t.env_correct_tool_calls > 0).mean())  # noqa: E731
    return (float(first.reward.mean()), rate(first)), (float(last.reward.mean()), rate(last))


@pytest.mark.slow
def test_tool_task_learns_to_call_the_tool(cluster, tmp_path):
    cfg = load_config("configs/tool.yaml", [f"run.out_dir={tmp_path}", f"run.compile_cache={CACHE}", *OVERRIDES])
    summary = driver.run(cfg, quiet=True)
    run = load_run(summary["run_dir"])
    traj = run.trajectories
    assert len(traj) == cfg.run.steps * cfg.learner.global_batch_groups * cfg.data.group_size
    assert not traj.mixed_versions.any(), "one weight version per trajectory, across all its turns"
    called = traj[traj.env_tool_calls > 0]
    # a call's result enters the trajectory, unless it would pass env.max_total_tokens (a long
    # error observation after a long turn): then the trajectory ends there, "length"
    cut = called.env_tool_tokens == 0
    assert (called[~cut].env_turns >= 2).all() and (called[cut].finish_reason == "length").all()
    assert cut.mean() < 0.1, cut.mean()
    assert (traj[traj.env_tool_calls == 0].env_tool_tokens == 0).all()
    (r0, c0), (r1, c1) = split_rates(traj)
    assert r1 > r0 + 0.1, (r0, r1)
    assert c1 > c0 + 0.1, (c0, c1)
    assert np.isfinite(run.metrics["loss/loss"]).all() and np.isfinite(run.metrics["loss/grad_norm"]).all()
    # the per-step tool metrics: every key in every row, and the correct-call rate rises there too
    m = run.metrics.sort_values("version")
    assert set(TOOL_METRIC_KEYS) <= set(m.columns) and m[list(TOOL_METRIC_KEYS)].notna().all().all()
    rate = m["tool/correct_call_rate"].to_numpy()
    assert rate[-4:].mean() > rate[:4].mean() + 0.1, rate
    assert (m["tool/env_errors"] == 0).all() and (m["tool/env_timeouts"] == 0).all()
    assert (m["tool/calls_per_traj"] > 0).all() and (m["tool/tool_token_frac"] > 0).all()
    # env.kv_policy: keep (the default): later turns reuse the kept K/V of the turns before them
    # (a trajectory repacked between turns re-prefills its next turn on its new rollout)
    again = traj[(traj.env_turns >= 2) & (traj.repack_count == 0)]
    assert (again.env_cached_tokens > 0).all() and (again.env_cached_tokens < again.env_context_tokens).all()
    moved = traj[traj.repack_count > 0]   # repack on (configs/tool.yaml): moved ones keep their turns
    print(f"\nrepacked trajectories: {len(moved)} of {len(traj)}")
    assert (moved.finish_reason != "abort").all() and (moved.env_env_error == 0).all()
    assert (m["tool/kv_reuse_frac"] > 0.5).all(), m["tool/kv_reuse_frac"].describe()
