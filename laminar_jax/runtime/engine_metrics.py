"""Per-engine metrics of a learner step: each pool's share, and each engine's log-prob mismatch.

    mismatch/<engine>/<key>   rl.mismatch.mismatch_metrics (abs_mean, abs_max, k1, k3, chi2,
                              num_tokens) of the learner's log-probs against the engine's
                              behaviour log-probs (raw, T=1), on the tokens that engine sampled
    pool/<name>/trajectories  trajectories of the step's batch from that pool

Which learner log-probs: each token's against the learner's params of the version that
generated it, so the two sides run the same weights and the mismatch is numerics only (kernels,
dtypes, the relay's rollout_dtype copy). The learner always has its current version v (token
staleness 0); `learner.mismatch_versions: K` keeps K past versions' params (a copy each), so
tokens up to K versions stale count too. Other tokens are left out, as their gap would also hold
the policy's change since. In sync mode every token counts; otherwise the measured share's count
is `num_tokens` (every value is 0 when there is none).

Where the current version's log-probs come from: the train step's own forward computes them for
the rows it trains on, before its update (`rl_step.TOKEN_LOGP`), so no separate pass is run when
that forward covers the whole batch at this version's params (`logp_from_train_step`). The
separate pass stays for past versions, and where the forward does not cover it: several
mini-batches of one batch (the later ones train on updated params), gradient accumulation
(micro-batches), packed rows of a learner over several hosts (one host unpacks its rows,
`batch.unpack`), a prox anchor at this version (the pass feeds the loss), and
rollout.zero_mismatch (its bit-for-bit check is of the standalone forward, the program the
engines' exact decoder mirrors; a forward fused with its backward is another XLA program).

Keys are fixed per run: one set for every engine kind and pool of `rollout.pools`.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np


def labels(cfg: Any) -> dict[str, tuple[str, str]]:
    """rollout id -> (pool name, engine) of every rollout of the run."""
    return {rid: (p.name, p.engine) for rid, p in cfg.rollout.assignments()}


def row_labels(cfg: Any, rollout_id: str, table: dict | None = None) -> dict[str, str | None]:
    """The `pool` / `engine` columns of one trajectory's log row."""
    pool, engine = (table or labels(cfg)).get(rollout_id, (None, None))
    return {"pool": pool, "engine": engine}


def logp_from_train_step(cfg: Any, mini_batch_rows: int) -> bool:
    """Whether each update takes this version's learner log-probs of its batch from the train
    step's forward (the module docstring says when it cannot)."""
    from laminar_jax.manager import modes

    lc, spec = cfg.learner, cfg.loss
    # streamed mini-batches: each part of the batch is its own update (of one mini-batch)
    one_update = lc.mini_batches == 1 or modes.streams_minibatches(cfg.manager.mode)
    prox_now = (spec.needs_prox or lc.recompute_prox) and not spec.needs_ewma
    micro = lc.micro_batch_size or mini_batch_rows
    return (one_update and micro == mini_batch_rows and not (lc.pack and lc.hosts > 1) and not prox_now
            and not getattr(cfg.rollout, "zero_mismatch", False))


def needs_batch_logp_pass(cfg: Any, mini_batch_rows: int) -> bool:
    """Whether the learner runs (and precompiles) the separate log-prob pass over the whole
    batch: where the train step's forward does not give this version's log-probs, or past
    versions' are kept (`learner.mismatch_versions`)."""
    return not logp_from_train_step(cfg, mini_batch_rows) or cfg.learner.mismatch_versions > 0


def at_token_versions(staleness: np.ndarray, logp_by_staleness: Mapping[int, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(log-probs, measured): each token's learner log-prob at its own version, taken from
    `logp_by_staleness[s]` (the learner's log-probs at version v - s, shape of `staleness`)
    where the token's staleness is s; `measured` is False where no such version is held."""
    logp = np.zeros(staleness.shape, np.float32)
    measured = np.zeros(staleness.shape, bool)
    for s, lp in logp_by_staleness.items():
        at_s = staleness == s
        logp = np.where(at_s, np.asarray(lp, np.float32), logp)
        measured |= at_s
    return logp, measured


def step_metrics(cfg: Any, batch: dict, learner_logp: np.ndarray, rollout_ids: Sequence[str],
                 measured: np.ndarray | None = None) -> dict[str, float]:
    """The module docstring's metrics for one assembled batch (rows in `rollout_ids` order).
    `measured`: the tokens whose `learner_logp` is at their own version (default: staleness 0)."""
    from laminar_jax.rl.mismatch import mismatch_metrics

    table = labels(cfg)
    engines = np.asarray([table.get(r, (None, None))[1] for r in rollout_ids], object)
    pools = [table.get(r, (None, None))[0] for r in rollout_ids]
    fresh = (batch["response_mask"] > 0) & (batch["staleness"] == 0 if measured is None else measured)
    out: dict[str, float] = {}
    for kind in sorted({e for _, e in table.values()}):
        mask = fresh & (engines == kind)[:, None]
        m = mismatch_metrics(np.asarray(learner_logp, np.float32), batch["behaviour_logp"], mask.astype(np.float32))
        out.update({f"mismatch/{kind}/{k}": float(v) for k, v in m.items()})
    for name in sorted({p for p, _ in table.values()}):
        out[f"pool/{name}/trajectories"] = float(sum(p == name for p in pools))
    return out
