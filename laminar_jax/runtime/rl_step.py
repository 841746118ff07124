"""The RL learner's jitted pieces, built once from the config: advantages, log-probs, train step.

    adv, adv_metrics = fns.advantages(batch, num_groups)       # AdvantageSpec, per group
    prox_logp        = fns.logprobs(fns.prox_params(state), batch)   # when LossSpec.needs_prox
    inputs           = fns.inputs(state.params, mini_batch)     # loss arrays + normaliser
    state, metrics   = fns.train(state, inputs)                 # one optimizer update

The train step's loss is `rl.compose.make_loss(cfg.loss)` applied to the learner's per-token
log-probs of the response tokens (`learner.logprobs.sequence_logprobs`), normalised by the
mini-batch's `rl.compose.loss_normaliser` so gradient accumulation over micro-batches gives the
big-batch gradient (`learner.train_step`). With `loss.aggregation.rejected_in_denominator=False`
that normaliser counts only the tokens the correction stage keeps (`rl.compose.kept_mask`, from
a log-prob pass of the current weights when the mask reads the learner). With
`loss.correction.old: ewma` the proximal log-probs come from the EWMA of the weights that the
optimizer keeps (`learner.optim.ewma_params`).
"""
from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from laminar_jax import sharding as shd
from laminar_jax.learner import logprobs as lp
from laminar_jax.learner.train_step import TrainStep
from laminar_jax.rl.advantages import advantages_from_spec
from laminar_jax.rl.ewma import ewma_params
from laminar_jax.rl.compose import keep_needs_learner, kept_mask, loss_normaliser, make_loss

TRAIN_KEYS = ("tokens", "positions", "segment_ids", "response_mask", "behaviour_logp", "staleness",
              "advantages")


class LearnerFns(NamedTuple):
    advantages: Any
    logprobs: Any
    train: TrainStep
    needs_prox: bool
    needs_ref: bool
    inputs: Any = None       # (params, mini-batch) -> the train step's inputs
    prox_params: Any = None  # state -> the weights prox_logp is recomputed with


def build(cfg: Any, setup: Any, *, mini_batch_rows: int) -> LearnerFns:
    """Jitted functions for `setup` (a `learner.setup.LearnerSetup`) and a mini-batch of
    `mini_batch_rows` sequences."""
    spec, adv_spec = cfg.loss, cfg.advantage
    sharded, chunk = setup.sharded, cfg.learner.logprob_chunk
    rl_loss = make_loss(spec)

    def loss_fn(params, mb):
        logp, ent = lp.sequence_logprobs(sharded.bind(params), mb["tokens"], mb["positions"],
                                         mb["segment_ids"], response_mask=mb["response_mask"],
                                         chunk_size=chunk, with_entropy=spec.needs_entropy)
        return rl_loss(logp, behaviour_logp=mb["behaviour_logp"], advantages=mb["advantages"],
                       mask=mb["response_mask"], prox_logp=mb.get("prox_logp"), ref_logp=mb.get("ref_logp"),
                       staleness=mb["staleness"], normaliser=mb["normaliser"], entropy=ent)

    micro = cfg.learner.micro_batch_size or mini_batch_rows
    div = shd.batch_divisor(setup.mesh)
    if mini_batch_rows % micro or micro % div:
        raise ValueError(f"learner.micro_batch_size={cfg.learner.micro_batch_size}: a mini-batch has "
                         f"{mini_batch_rows} sequences (global_batch_groups / mini_batches x group_size), "
                         f"which must be a multiple of the micro-batch, itself a multiple of the mesh's "
                         f"data x fsdp = {div}")
    train = TrainStep(loss_fn, setup.tx, setup.shardings, schedule=setup.schedule,
                      num_micro_batches=mini_batch_rows // micro, metric_reduction="mean")

    @partial(jax.jit, static_argnames="num_groups")
    def advantages(rewards, group_ids, response_mask, num_groups):
        return advantages_from_spec(adv_spec, rewards=rewards, group_ids=group_ids,
                                    valid=jnp.ones_like(rewards, bool), response_mask=response_mask > 0,
                                    num_groups=num_groups)

    def adv_fn(batch, num_groups):
        adv, m = advantages(batch["rewards"], batch["group_ids"], batch["response_mask"], num_groups)
        return np.asarray(adv, np.float32), {f"adv/{k}": float(v) for k, v in jax.device_get(m).items()}

    logp_jit = lp.make_logprobs_fn(sharded, chunk_size=chunk)

    def logprobs(params, batch):
        logp, _ = logp_jit(params, *(shd.shard_batch(batch[k], setup.mesh) for k in
                                     ("tokens", "positions", "segment_ids", "response_mask")))
        return np.asarray(logp, np.float32)

    kept_jit = jax.jit(partial(kept_mask, spec))

    def inputs(params, mb):
        keep = None
        if not spec.aggregation.rejected_in_denominator:
            learner = logprobs(params, mb) if keep_needs_learner(spec) else None
            keep = kept_jit(mask=mb["response_mask"], behaviour_logp=mb["behaviour_logp"],
                            advantages=mb["advantages"], learner_logp=learner,
                            prox_logp=mb.get("prox_logp"), staleness=mb["staleness"])
        return train_inputs(cfg, mb, keep_mask=keep)

    def prox_params(state):
        return ewma_params(state.opt_state) if spec.needs_ewma else state.params

    return LearnerFns(adv_fn, logprobs, train, spec.needs_prox or cfg.learner.recompute_prox,
                      spec.needs_ref, inputs, prox_params)


def train_inputs(cfg: Any, mb: dict[str, np.ndarray], *, keep_mask: Any = None) -> dict[str, Any]:
    """The mini-batch as the train step takes it: the arrays the loss reads plus its normaliser
    (over the kept tokens `keep_mask` when rejected tokens leave the denominator)."""
    keys = TRAIN_KEYS + tuple(k for k in ("prox_logp", "ref_logp") if k in mb)
    out = {k: mb[k] for k in keys}
    out["normaliser"] = np.float32(loss_normaliser(cfg.loss, jnp.asarray(mb["response_mask"]),
                                                   keep_mask=keep_mask))
    return out


def scalar_metrics(metrics: dict, prefix: str = "") -> dict[str, float]:
    """The scalar entries of a metrics dict (histograms and vectors are left out)."""
    return {prefix + k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}
