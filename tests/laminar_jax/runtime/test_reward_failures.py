"""`laminar train` with a reward that always raises: the rollouts score it in their reward pools,
the driver prints the failure with its traceback, and the run stops with one clear line and exit
code 1 once more than reward.max_error_rate of the last reward.error_window completions failed
(before: exit 0, reward 0 everywhere, only reward_error events)."""
import pytest

from laminar_jax import cli

pytestmark = pytest.mark.slow


def test_a_broken_reward_stops_laminar_train_with_its_traceback(cluster, warm_model, tmp_path, capsys):
    spec = "tests.laminar_jax.rewards.user_rewards:always_raises"
    overrides = [f"run.out_dir={tmp_path}", "run.name=broken_reward", f"model.hf_path={warm_model}",
                 "data.task=arithmetic", "data.group_size=8", "data.num_prompts=512", "data.task_max_n=9",
                 "learner.global_batch_groups=2", "learner.max_seq_len=32", "rollout.max_new_tokens=8",
                 "rollout.max_concurrency=16", "rollout.kv_budget_tokens=512", "run.steps=20",
                 "rollout.num_rollouts=1", "relay.enabled=false",  # the least to start: one rollout
                 f"reward.fn={spec}", "reward.error_window=16"]
    rc = cli.main(["train", "configs/default.yaml", *overrides])
    out, err = capsys.readouterr()
    assert rc == 1, err
    assert f"reward.fn '{spec}':" in out and "'raised' of" in out
    assert "Traceback" in out and "RuntimeError: this reward is broken" in out
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert line.startswith(f"error: reward.fn '{spec}': ") and "> reward.max_error_rate=0.5; raised " in line
    assert "step   19/19" not in out  # stopped early (steps print 0-based, as the metrics)
