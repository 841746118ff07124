"""PPO-EWMA proximal policy: an exponentially weighted moving average of the learner's weights.

Hilton et al., "Batch size-invariance for policy optimization" (arXiv 2110.00641) decouple the
proximal policy (the PPO anchor) from the behaviour policy and take as proximal weights an EWMA
of the trained weights; Guan et al. (arXiv 2605.12070) adopt a revised PPO-EWMA when the old
logits of an asynchronous pipeline are missing. After every optimizer update theta_k:

    theta_ewma <- beta * theta_ewma + (1 - beta) * theta_k,        theta_ewma(0) = theta_0

so theta_ewma weighs the weights of k updates ago by (1 - beta) beta^k (mean age beta / (1 -
beta) updates; beta = 0 is the current weights, the plain `prox` recompute). The loss then uses
`correction.old: ewma` exactly as `prox`: the learner recomputes `prox_logp` with theta_ewma.

The average lives in the optimizer state (`ewma_tracker`, the last link of the optax chain), so
it is sharded like the params, checkpointed and restored with them, and skipped with them when
a non-finite update is dropped. Only the abstract of arXiv 2605.12070 was available: the
"revision" it makes is not reproduced; this is Hilton et al.'s EWMA (docs/corrections.md).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class EwmaState(NamedTuple):
    """The EWMA of the weights after the last update (same tree, dtypes and shardings)."""

    params: Any


def ewma_tracker(decay: float) -> optax.GradientTransformation:
    """Identity on the updates; its state follows theta_ewma of the module docstring.

    Chain it last (`optax.chain(tx, ewma_tracker(beta))`): it sees the final updates u and the
    params theta before the update, and averages in theta + u, the weights after it.
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"rl.ewma.ewma_tracker: decay={decay!r}; expected 0 <= decay < 1")

    def init(params):
        return EwmaState(jax.tree.map(jnp.copy, params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("rl.ewma.ewma_tracker: update() needs params")
        new = optax.apply_updates(params, updates)
        avg = jax.tree.map(lambda e, p: (decay * e.astype(jnp.float32) + (1.0 - decay)
                                         * p.astype(jnp.float32)).astype(e.dtype),
                           state.params, new)
        return updates, EwmaState(avg)

    return optax.GradientTransformation(init, update)


def ewma_params(opt_state: Any) -> Any:
    """The EWMA weights held by the `ewma_tracker` inside an optimizer state (any nesting)."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, EwmaState))
             if isinstance(s, EwmaState)]
    if len(found) != 1:
        raise ValueError(f"rl.ewma.ewma_params: the optimizer state holds {len(found)} EWMA "
                         f"trackers; expected 1 (build the optimizer with ewma_tracker, i.e. "
                         f"loss.correction.old: ewma)")
    return found[0].params
