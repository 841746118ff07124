"""The learner's jitted RL step (runtime/rl_step.py) on a tiny real model: the options that only
the learner can honour -- rejected tokens out of the denominator, the entropy metric, the PPO-EWMA
anchor -- checked against closed forms built from independent passes."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.config import load_config
from laminar_jax.learner.setup import build as build_setup
from laminar_jax.rl.compose import make_loss
from laminar_jax.rl.kl import entropy_from_logits
from laminar_jax.runtime import rl_step

ROWS, LEN, PROMPT = 8, 24, 6


def _fns(*overrides, steps=4):
    cfg = load_config(None, ["learner.global_batch_groups=2", "data.group_size=4",
                             "optimizer.lr=0.05", f"run.steps={steps}", *overrides])
    setup = build_setup(cfg, total_steps=steps)
    return cfg, setup, rl_step.build(cfg, setup, mini_batch_rows=ROWS)


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    vocab = cfg.model.vocab_size
    lengths = rng.integers(PROMPT + 4, LEN + 1, ROWS)
    tokens = rng.integers(0, vocab, (ROWS, LEN)).astype(np.int32)
    seg = (np.arange(LEN)[None] < lengths[:, None]).astype(np.int32)
    pos = np.where(seg > 0, np.arange(LEN)[None], 0).astype(np.int32)
    resp = ((np.arange(LEN)[None] >= PROMPT) & (seg > 0)).astype(np.float32)
    adv = np.repeat(rng.normal(size=(ROWS, 1)).astype(np.float32), LEN, 1) * resp
    return {"tokens": tokens, "positions": pos, "segment_ids": seg, "response_mask": resp,
            "staleness": np.zeros((ROWS, LEN), np.float32), "advantages": adv}


def _with_behaviour(fns, state, mb, seed=1):
    """behaviour = the current weights' log-probs shifted by +-0.5 on a third of the tokens."""
    logp = fns.logprobs(state.params, mb)
    rng = np.random.default_rng(seed)
    shift = rng.choice([0.0, 0.5, -0.5], size=logp.shape, p=[2 / 3, 1 / 6, 1 / 6])
    return dict(mb, behaviour_logp=(logp + shift * mb["response_mask"]).astype(np.float32)), logp


def test_rejected_out_of_the_denominator_and_entropy_through_the_train_step():
    """`aggregation.rejected_in_denominator=false` used to raise at the first update (the keep
    mask never reached the normaliser). In bypass mode the token-rejection mask reads the learner,
    so `fns.inputs` runs a log-prob pass of the current weights: the normaliser counts the kept
    tokens and the step's loss is sum(kept token losses) / N_kept. The same step's loss/entropy
    is the entropy of the model's full-vocabulary softmax (log_entropy, on by default)."""
    cfg, setup, fns = _fns("loss.correction.old=behaviour", "loss.correction.reject_level=token",
                           "loss.correction.reject_low=0.8", "loss.correction.reject_high=1.25",
                           "loss.aggregation.rejected_in_denominator=false",
                           "learner.logprob_chunk=8")
    mb, logp = _with_behaviour(fns, setup.state, _batch(cfg))
    model = setup.sharded.bind(setup.state.params)
    logits = model(jnp.asarray(mb["tokens"]), jnp.asarray(mb["positions"]),
                   jnp.asarray(mb["segment_ids"]))
    h = np.asarray(entropy_from_logits(logits))[:, :-1]       # entropy of the next token
    inputs = fns.inputs(setup.state.params, mb)
    m = mb["response_mask"]
    kept = m * (np.abs(mb["behaviour_logp"] - logp) < 0.4)
    assert 0 < kept.sum() < m.sum()
    np.testing.assert_allclose(inputs["normaliser"], kept.sum())
    in_den = dataclasses.replace(cfg, loss=dataclasses.replace(
        cfg.loss, aggregation=dataclasses.replace(cfg.loss.aggregation,
                                                  rejected_in_denominator=True)))
    np.testing.assert_allclose(rl_step.train_inputs(in_den, mb)["normaliser"], m.sum())
    _, metrics = fns.train(setup.state, inputs)
    # closed form: the ratio to mu is exp(sg(l) - l_mu), 1 on kept tokens (|shift| = 0), and
    # PPO at r = 1 is -A; rejected tokens (|shift| = 0.5) contribute nothing
    want = (-mb["advantages"] * kept).sum() / kept.sum()
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["masked_frac"], 1 - kept.sum() / m.sum(), rtol=1e-5)
    # token t's entropy is that of the distribution it was drawn from: logits at t - 1
    np.testing.assert_allclose(metrics["entropy"], (h * kept[:, 1:]).sum() / kept.sum(),
                               rtol=1e-4)
    assert float(metrics["entropy"]) > 0.5


def test_ppo_ewma_anchor_is_the_average_of_the_weights():
    """correction.old=ewma: after each update theta_ewma = beta theta_ewma + (1 - beta) theta
    (kept in the optimizer state), prox_logp is recomputed with theta_ewma, and the step's loss
    is the loss anchored there, not at the current weights (what 'prox' would use)."""
    beta = 0.75
    cfg, setup, fns = _fns("loss.correction.old=ewma", f"loss.correction.ewma_decay={beta}")
    spec = cfg.loss
    state = setup.state
    thetas = [jax.tree.map(np.asarray, state.params)]
    mb = _batch(cfg, seed=5)
    mb["behaviour_logp"] = fns.logprobs(state.params, mb)
    for step in range(2):
        mb["prox_logp"] = fns.logprobs(fns.prox_params(state), mb)
        current = fns.logprobs(state.params, mb)
        inputs = fns.inputs(state.params, mb)
        kw = dict(behaviour_logp=mb["behaviour_logp"], advantages=mb["advantages"],
                  mask=mb["response_mask"], staleness=mb["staleness"],
                  normaliser=inputs["normaliser"])
        ewma_loss, _ = make_loss(spec)(jnp.asarray(current), prox_logp=mb["prox_logp"], **kw)
        prox_loss, _ = make_loss(spec)(jnp.asarray(current), prox_logp=current, **kw)
        state, metrics = fns.train(state, inputs)
        thetas.append(jax.tree.map(np.asarray, state.params))
        np.testing.assert_allclose(metrics["loss"], ewma_loss, rtol=1e-4, atol=1e-6)
        if step == 0:  # theta_ewma = theta0 = the current weights
            np.testing.assert_allclose(ewma_loss, prox_loss, rtol=1e-6)
        else:  # the anchors differ, and so do the losses
            assert abs(float(ewma_loss) - float(prox_loss)) > 1e-5
    t0, t1, t2 = thetas
    want = jax.tree.map(lambda a, b, c: beta * (beta * a + (1 - beta) * b) + (1 - beta) * c,
                        t0, t1, t2)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7),
                 jax.tree.map(np.asarray, fns.prox_params(state)), want)
