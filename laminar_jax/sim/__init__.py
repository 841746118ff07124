"""Discrete-event cluster simulator: `laminar simulate CONFIG [key=value ...]`.

Replays the five scheduling modes (sync, one_step, stream, partial, laminar) with the repack and
relay toggles at up to 1024 accelerators, driven by the runtime's own pure rules
(`laminar_jax.manager.modes`, `laminar_jax.manager.repack.plan`, `laminar_jax.weights.chain`)
and by physical models calibrated on the Laminar paper (docs/simulator.md).

Modules: config (schema), models (decode / trainer / weights / lengths), rollout (one engine,
closed-form decode), engine (event core), policies (picks the mode's policy: global_batch,
partial, laminar, on policy_base), report (run folders, tables),
cli (entry point). Pure python + numpy: no jax import.
"""
