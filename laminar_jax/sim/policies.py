"""Scheduling policies of the five modes, driving the simulator core.

The rules come from the runtime's pure functions, not copies: staleness bounds and admission
from `laminar_jax.manager.modes`, the repack plan from `laminar_jax.manager.repack.plan`, relay
arrival from `laminar_jax.weights.chain` (through `Sim.relay_version`). One module per family:

- `global_batch.GlobalBatch` (sync, one_step, stream): one global batch at a time, global sync.
- `partial.Partial` (AReaL): continuous refill, every publish interrupts every rollout.
- `laminar.Laminar`: per-rollout batches on one version, relays, repack.

`policy_base.Policy` holds what they share (learner gate, FIFO training, spreading work).
"""

from __future__ import annotations

from laminar_jax.manager import modes
from laminar_jax.sim.global_batch import GlobalBatch
from laminar_jax.sim.laminar import Laminar
from laminar_jax.sim.partial import Partial
from laminar_jax.sim.policy_base import Policy

__all__ = ["make_policy", "Policy", "GlobalBatch", "Partial", "Laminar"]


def make_policy(sim) -> Policy:
    """The policy of `sim.mode`, chosen by its `modes.ModeRules` row: global batches ->
    GlobalBatch (any staleness bound), interrupts on publish -> Partial, otherwise
    trajectory-level -> Laminar."""
    r = modes.rules(sim.mode)
    if r.global_batches:
        return GlobalBatch(sim)
    if r.interrupts_on_publish:
        return Partial(sim)
    return Laminar(sim)
