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
from laminar_jax.learner import distributed as dist
from laminar_jax.learner import logprobs as lp
from laminar_jax.learner.train_step import AheadOfTime, TrainStep
from laminar_jax.models.grad_accumulation import decoder_params_into
from laminar_jax.rl.advantages import advantages_from_spec
from laminar_jax.runtime import batch as B
from laminar_jax.runtime import host_batch
from laminar_jax.rl.compose import keep_needs_learner, kept_mask, loss_normaliser, make_loss
from laminar_jax.rl.ewma import ewma_params

# the train step's metric holding its forward's per-token log-probs [rows, length] (one
# micro-batch only: LearnerFns.token_logp); the learner's mismatch metrics read it
TOKEN_LOGP = "token_logp"
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
    row_multiple: int = 1     # packed row counts are multiples of this (micro-batches x batch shards)
    mini_batch_rows: int = 1  # trajectories (unpacked rows) per mini-batch
    precompile: Any = None    # precompile(state, rows, length, ...): the shapes of `batch_shapes`
    release: Any = None       # release(): drop `precompile(..., reserve=True)` promises not compiled
    loss: Any = None          # the un-jitted loss_fn(params, train_inputs) -> (loss, metrics)
    token_logp: bool = False  # the train step's metrics hold TOKEN_LOGP


def build(cfg: Any, setup: Any, *, mini_batch_rows: int, batch_logp: bool = True) -> LearnerFns:
    """Jitted functions for `setup` (a `learner.setup.LearnerSetup`) and a mini-batch of
    `mini_batch_rows` sequences; `batch_logp`: the learner runs a log-prob pass over the whole
    assembled batch (precompiled with the rest)."""
    spec, adv_spec = cfg.loss, cfg.advantage
    sharded, chunk = setup.sharded, cfg.learner.logprob_chunk
    rl_loss = make_loss(spec)
    train_shardings = sharded.train_shardings()

    def loss_fn(params, mb, grad_acc=None):
        # gradient accumulation inside the backward pass (learner.train_step's loss_accumulates)
        params, layer_acc = decoder_params_into(params, grad_acc)
        logp, ent = lp.sequence_logprobs(sharded.bind(params), mb["tokens"], mb["positions"],
                                         mb["segment_ids"], response_mask=mb["response_mask"],
                                         chunk_size=chunk, with_entropy=spec.needs_entropy,
                                         shardings=train_shardings, layer_grad_acc=layer_acc)
        # segment ids: a packed row holds several sequences (sequence-level aggregation per segment)
        loss, metrics = rl_loss(logp, behaviour_logp=mb["behaviour_logp"], advantages=mb["advantages"],
                                mask=mb["response_mask"], prox_logp=mb.get("prox_logp"),
                                ref_logp=mb.get("ref_logp"), staleness=mb["staleness"],
                                normaliser=mb["normaliser"], entropy=ent, segment_ids=mb["segment_ids"])
        if token_logp_aux:   # the forward's per-token log-probs, at the pre-update params
            metrics = dict(metrics, **{TOKEN_LOGP: jax.lax.stop_gradient(logp)})
        return loss, metrics

    micro = cfg.learner.micro_batch_size or mini_batch_rows
    # one micro-batch: the step's metrics carry the learner's per-token log-probs of its rows
    # (accumulated over micro-batches they would be summed rows of different sequences)
    token_logp_aux = micro == mini_batch_rows
    div = shd.batch_divisor(setup.mesh)
    if mini_batch_rows % micro or micro % div:
        raise ValueError(f"learner.micro_batch_size={cfg.learner.micro_batch_size}: a mini-batch has "
                         f"{mini_batch_rows} sequences (global_batch_groups / mini_batches x group_size), "
                         f"which must be a multiple of the micro-batch, itself a multiple of the mesh's "
                         f"data x fsdp = {div}")
    train = TrainStep(loss_fn, setup.tx, setup.shardings, schedule=setup.schedule,
                      num_micro_batches=mini_batch_rows // micro, metric_reduction="mean",
                      loss_accumulates=True)

    def advantages(rewards, group_ids, valid, response_mask, num_groups):
        return advantages_from_spec(adv_spec, rewards=rewards, group_ids=group_ids,
                                    valid=valid > 0, response_mask=response_mask > 0,
                                    num_groups=num_groups)
    adv_aot: dict = {}  # (num_groups) -> AheadOfTime (num_groups is static)

    def adv_call(num_groups, *args):
        return adv_jit(num_groups)(*args)

    def adv_jit(num_groups):
        if num_groups not in adv_aot:
            adv_aot[num_groups] = AheadOfTime(jax.jit(partial(advantages, num_groups=num_groups)))
        return adv_aot[num_groups]

    def adv_fn(batch, num_groups):
        valid = batch.get("valid", np.ones_like(batch["rewards"]))
        adv, m = adv_call(num_groups, batch["rewards"], batch["group_ids"], valid, batch["response_mask"])
        return np.asarray(adv, np.float32), {f"adv/{k}": float(v) for k, v in jax.device_get(m).items()}

    logp_jit = AheadOfTime(lp.make_logprobs_fn(sharded, chunk_size=chunk))
    logp_keys = ("tokens", "positions", "segment_ids", "response_mask")

    def logprobs(params, batch):   # several learner hosts: `batch` is this host's rows, and so is the result
        logp, _ = logp_jit(params, *(dist.global_arrays(batch[k], setup.mesh) for k in logp_keys))
        return np.asarray(host_batch.local_rows(dist.to_host(logp), batch["tokens"].shape[0]), np.float32)
    logprobs.aot = logp_jit   # its call_compiles: the learner's `learner/logprob_compiles` metric

    kept_jit = jax.jit(partial(kept_mask, spec))

    def inputs(params, mb):
        keep = None
        if not spec.aggregation.rejected_in_denominator:
            learner = logprobs(params, mb) if keep_needs_learner(spec) else None
            keep = kept_jit(mask=mb["response_mask"], behaviour_logp=mb["behaviour_logp"],
                            segment_ids=mb["segment_ids"],
                            advantages=mb["advantages"], learner_logp=learner,
                            prox_logp=mb.get("prox_logp"), staleness=mb["staleness"])
        return train_inputs(cfg, mb, keep_mask=keep)

    def prox_params(state):
        return ewma_params(state.opt_state) if spec.needs_ewma else state.params

    needs_prox = spec.needs_prox or cfg.learner.recompute_prox
    extra = tuple(k for k, need in (("prox_logp", needs_prox), ("ref_logp", spec.needs_ref)) if need)

    def precompile(state, rows, length, num_groups, adv_rows, *, reserve=False):
        """Compile the update's jitted pieces for mini-batches of rows x length (advantages
        over the assembled batch of adv_rows x length, num_groups groups); `reserve`: only
        promise it (calls of those shapes then wait for the compile instead of compiling)."""
        how = "reserve" if reserve else "precompile"
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        state = jax.tree.map(abstract, state)
        arr = lambda dt, *shape: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
        ints = ("tokens", "positions", "segment_ids")
        tok = {k: arr(jnp.int32 if k in ints else jnp.float32, rows, length) for k in TRAIN_KEYS + extra}
        # in the order a step calls them: advantages, log-probs, update
        if not cfg.learner.pack:  # advantages run on the unpacked batch (all mini-batches)
            n = adv_rows
            f32, i32 = arr(jnp.float32, n), arr(jnp.int32, n)
            getattr(adv_jit(num_groups), how)(f32, i32, f32, arr(jnp.float32, n, length))
            # the learner's log-probs of the whole batch (the engines' mismatch metrics, every
            # step): without this the first step of each bucket compiled them on the critical path
            if batch_logp:
                full = {k: arr(jnp.int32 if k in ints else jnp.float32, n, length) for k in logp_keys}
                getattr(logp_jit, how)(state.params, *(full[k] for k in logp_keys))
        if needs_prox or spec.needs_ref:   # the same signature as above: a no-op then
            getattr(logp_jit, how)(state.params, *(tok[k] for k in logp_keys))
        getattr(train, how)(state, {**tok, "normaliser": arr(jnp.float32)})

    def release():
        for aot in (train, logp_jit, *adv_aot.values()):
            aot.release()

    return LearnerFns(adv_fn, logprobs, train, needs_prox, spec.needs_ref, inputs, prox_params,
                      row_multiple=(mini_batch_rows // micro) * div, mini_batch_rows=mini_batch_rows,
                      precompile=precompile, release=release, loss=loss_fn, token_logp=token_logp_aux)


def batch_shapes(cfg: Any, fns: LearnerFns, *, max_row_tokens: int | None = None) -> list[tuple[int, int]]:
    """Every (rows, length) a mini-batch can have, known before the first batch: unpacked, the
    mini-batch's trajectories x each length bucket up to the one holding `max_row_tokens` (the
    run's longest possible row, `batch.row_reach`; None: every bucket); packed, each row bucket x
    max_seq_len."""
    lc = cfg.learner
    if lc.pack:
        return [(r, lc.max_seq_len) for r in B.row_buckets(fns.mini_batch_rows, fns.row_multiple)]
    buckets = B.length_buckets(lc.max_seq_len, min(lc.min_bucket, lc.max_seq_len))
    if max_row_tokens is not None:
        top = next(b for b in buckets if b >= min(max_row_tokens, lc.max_seq_len))
        buckets = tuple(b for b in buckets if b <= top)
    return [(fns.mini_batch_rows, n) for n in buckets]


def precompile_all(cfg: Any, fns: LearnerFns, state: Any, *, num_groups: int, events: Any = None,
                   after_first: Any = None, max_row_tokens: int | None = None) -> None:
    """`fns.precompile` every shape of `batch_shapes`, smallest first (for a background thread);
    `num_groups`: the groups of one assembled batch (a global batch, or a mini-batch's worth when
    mini-batches stream); `after_first()` is called once the smallest shape is compiled."""
    adv_rows = num_groups * cfg.data.group_size
    shapes = sorted(batch_shapes(cfg, fns, max_row_tokens=max_row_tokens), key=lambda s: s[0] * s[1])
    try:
        for rows, length in shapes:  # first promise them all: no step compiles one of them itself
            fns.precompile(state, rows, length, num_groups, adv_rows, reserve=True)
        for i, (rows, length) in enumerate(shapes):
            fns.precompile(state, rows, length, num_groups, adv_rows)
            if i == 0 and after_first is not None:
                after_first()
    finally:
        fns.release()
    if events is not None:
        events("precompiled", shapes=len(shapes))


def train_inputs(cfg: Any, mb: dict[str, np.ndarray], *, keep_mask: Any = None) -> dict[str, Any]:
    """The mini-batch as the train step takes it: the arrays the loss reads plus its normaliser
    (over the kept tokens `keep_mask` when rejected tokens leave the denominator). Several
    learner hosts: `mb` is this host's rows, and the normaliser, a sum of per-row shares
    (`rl.compose.loss_normaliser`), is summed over the hosts (a collective)."""
    keys = TRAIN_KEYS + tuple(k for k in ("prox_logp", "ref_logp") if k in mb)
    out = {k: mb[k] for k in keys}
    share = np.float32(loss_normaliser(cfg.loss, jnp.asarray(mb["response_mask"]),
                                       segment_ids=jnp.asarray(mb["segment_ids"]),
                                       keep_mask=keep_mask))
    out["normaliser"] = np.float32(dist.sum_over_hosts(share)) if jax.process_count() > 1 else share
    return out


def scalar_metrics(metrics: dict, prefix: str = "") -> dict[str, float]:
    """The scalar entries of a metrics dict (histograms and vectors are left out)."""
    return {prefix + k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}
