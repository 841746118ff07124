"""`laminar sft` learns the built-in task: the response cross-entropy falls clearly."""
import numpy as np
import pytest

from laminar_jax.analysis import load_run
from laminar_jax.config import Config, MeshConfig, RunConfig, SftConfig
from laminar_jax.data.tasks import get_task
from laminar_jax.learner import sft
from laminar_jax.metrics import RunWriter
from laminar_jax.models.hf import load_pretrained


def test_pack_examples_keeps_examples_apart_and_masks_prompts():
    examples = get_task("arithmetic").sft_examples(20, seed=0)
    order = np.arange(len(examples))
    batch, nxt = sft.pack_examples(examples, order, 0, batch_size=2, seq_len=12)
    for row in range(2):
        seg = batch["segment_ids"][row]
        for s in set(seg[seg > 0].tolist()):
            idx = np.flatnonzero(seg == s)
            assert np.all(np.diff(idx) == 1)                              # contiguous
            np.testing.assert_array_equal(batch["positions"][row, idx], np.arange(len(idx)))
    # every packed example appears with its prompt masked and its response (EOS included) scored
    used = [examples[i] for i in order[:nxt]]
    assert batch["num_loss_tokens"] == sum(len(e.response_tokens) for e in used)
    first = used[0]
    n_p, n = len(first.prompt_tokens), len(first.prompt_tokens) + len(first.response_tokens)
    np.testing.assert_array_equal(batch["tokens"][0, :n],
                                  np.concatenate([first.prompt_tokens, first.response_tokens]))
    np.testing.assert_array_equal(batch["loss_mask"][0, :n], [0] * n_p + [1] * (n - n_p))
    with pytest.raises(ValueError, match="sft.seq_len=3 is shorter"):
        sft.pack_examples(examples, order, 0, batch_size=1, seq_len=3)


def test_sft_loss_falls_and_writes_the_run(tmp_path):
    cfg = Config(run=RunConfig(name="sft", out_dir=str(tmp_path), seed=0, log_every=5),
                 mesh=MeshConfig(data=-1, fsdp=1, tensor=1),
                 sft=SftConfig(steps=25, batch_size=16, seq_len=64, lr=3e-3))
    with RunWriter(tmp_path / "sft", cfg, tensorboard=False) as train:  # a train run of the same name
        for step in range(3):
            train.log_step(step, {"reward_mean": 0.5})
    out = sft.run(cfg)
    assert list(load_run(tmp_path / "sft").metrics.reward_mean) == [0.5] * 3  # untouched by sft
    losses = out["losses"]
    assert len(losses) == 25 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < 0.5 * np.mean(losses[:3]), losses
    assert out["run_dir"] == str(tmp_path / "sft" / "sft")  # its own folder, beside a train run's files
    metrics = load_run(out["run_dir"]).metrics
    np.testing.assert_allclose(metrics["sft/loss"], losses, rtol=1e-6)
    # the trained model round-trips as a HF folder a later run can start from
    dcfg, params = load_pretrained(out["model_dir"])
    assert dcfg.num_layers == 2 and (tmp_path / "sft" / "sft" / "sft_model" / "tokenizer.json").exists()
