"""The config fields of the learner's attention, remat and buckets reach the code that uses them."""
import dataclasses

import jax
import pytest

from laminar_jax.config import Config, LearnerConfig, ModelConfig, RunConfig
from laminar_jax.learner.setup import build, model_config
from laminar_jax.runtime import rl_step


def test_model_attention_reaches_the_decoder_and_is_checked_against_the_backend():
    assert model_config(ModelConfig(attention="naive"))[0].attention == "naive"
    assert model_config(ModelConfig())[0].attention == "auto"
    with pytest.raises(ValueError, match=r"model.attention: 'cudnn' is not available on the 'cpu' backend"):
        build(Config(model=ModelConfig(attention="cudnn")), total_steps=1)


def test_learner_remat_and_buckets_reach_the_step():
    cfg = Config(run=RunConfig(steps=2), learner=LearnerConfig(remat="dots_saveable", max_seq_len=256,
                                                               min_bucket=32, global_batch_groups=2))
    setup = build(cfg, total_steps=2)
    assert setup.sharded.bind(setup.state.params).remat == "dots_saveable"
    fns = rl_step.build(cfg, setup, mini_batch_rows=2 * cfg.data.group_size)
    assert [n for _, n in rl_step.batch_shapes(cfg, fns)] == [32, 64, 128, 256]
    # the run's longest possible row (batch.row_reach) drops the buckets past the one holding it
    assert [n for _, n in rl_step.batch_shapes(cfg, fns, max_row_tokens=84)] == [32, 64, 128]
    assert [n for _, n in rl_step.batch_shapes(cfg, fns, max_row_tokens=128)] == [32, 64, 128]
    assert [n for _, n in rl_step.batch_shapes(cfg, fns, max_row_tokens=129)] == [32, 64, 128, 256]
    assert [n for _, n in rl_step.batch_shapes(cfg, fns, max_row_tokens=999)] == [32, 64, 128, 256]
    packed = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, pack=True))
    assert {n for _, n in rl_step.batch_shapes(packed, fns)} == {256}
    assert {n for _, n in rl_step.batch_shapes(packed, fns, max_row_tokens=84)} == {256}


def test_memory_options_reach_the_learner_and_bad_values_name_the_key(tmp_path):
    """optimizer.state_dtype reaches the optimizer state and learner.mlp_chunk the decoder of
    the setup `laminar train` builds; bad values fail at load naming the dotted key."""
    from laminar_jax.config import OptimizerConfig
    from laminar_jax.config_loader import ConfigError, load_config
    cfg = Config(run=RunConfig(steps=2), optimizer=OptimizerConfig(state_dtype="bfloat16"),
                 learner=LearnerConfig(mlp_chunk=16))
    setup = build(cfg, total_steps=2)
    adam = setup.state.opt_state[1][0]  # chain(clip, chain(adam, ...))
    assert {str(x.dtype) for x in jax.tree.leaves((adam.mu, adam.nu))} == {"bfloat16"}
    assert setup.sharded.bind(setup.state.params).mlp_chunk == 16
    from laminar_jax.learner.optim import optimizer_from_config
    tx, _ = optimizer_from_config(OptimizerConfig(), total_steps=2)  # the default: fp32 moments
    assert {str(x.dtype) for x in jax.tree.leaves(jax.eval_shape(tx.init, setup.state.params)[1][0].mu)} == {"float32"}
    path = tmp_path / "c.yaml"
    path.write_text("run: {steps: 2}\n")
    with pytest.raises(ConfigError, match=r"optimizer.state_dtype"):
        load_config(path, ["optimizer.state_dtype=fp8"])
    with pytest.raises(ConfigError, match=r"learner.mlp_chunk"):
        load_config(path, ["learner.mlp_chunk=-1"])
