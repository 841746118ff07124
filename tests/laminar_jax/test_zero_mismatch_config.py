"""`rollout.zero_mismatch`: refused up front where it cannot hold (vLLM, tempered or truncated
sampling, a rollout dtype other than the learner's), and read by both sides of a run: the
engine factory's and the learner's decoder configs switch to the exact (batch-invariant) one."""
import pytest

from laminar_jax.config import ConfigError, load_config
from laminar_jax.runtime import engines

DEFAULT = "configs/default.yaml"


@pytest.mark.parametrize("overrides, says", [
    (["rollout.engine=vllm"], "engine jax in every pool"),
    (["rollout.num_rollouts=2", "rollout.pools=[{engine: jax, num_rollouts: 1}, {engine: vllm, num_rollouts: 1}]"],
     "pools ['pool1'] use vllm"),
    (["rollout.temperature=0.7"], "rollout.temperature=1"),
    (["rollout.top_p=0.9"], "top_p=1"),
    (["model.rollout_dtype=bfloat16"], "model.rollout_dtype == model.dtype"),
    (["model.attention=naive"], "model.attention auto or exact"),
])
def test_zero_mismatch_where_it_cannot_hold_fails_naming_the_key(overrides, says):
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT, ["rollout.zero_mismatch=true", *overrides])
    msg = str(info.value)
    assert "rollout.zero_mismatch" in msg and says in msg, msg
    load_config(DEFAULT, overrides)  # the same config without the flag is fine


def test_the_flag_switches_engine_and_learner_to_the_exact_decoder():
    off = load_config(DEFAULT, [])
    on = load_config(DEFAULT, ["rollout.zero_mismatch=true", "model.rollout_dtype=bfloat16", "model.dtype=bfloat16"])
    assert engines.model_config(off, None).attention == "auto"
    assert engines.model_config(on, None).attention == "exact"
    assert engines.model_config(on, None).dtype == "bfloat16"
    # the learner side (learner.setup.build) is shown by the partial-mode run's mismatch == 0
    # (tests/laminar_jax/runtime/test_modes_train.py): it can only hold with both sides exact
