"""The JAX learner: sharded train state, the generic jitted train step, log-probs and SFT.

- `train_state`: `ShardedModel` (graph + rule-derived param shardings), `TrainState(params,
  opt_state, step)`, `shard_model`, `init_params`, `place_params`, `init_train_state`.
- `train_step`: `TrainStep(loss_fn, tx, shardings, ...)` (gradient accumulation, donation,
  `NonFiniteLossError`).
- `optim`: AdamW + global-norm clipping + warmup/decay schedule.
- `logprobs`: chunked per-token log-probs and entropies of packed sequences.
- `setup`: `build(cfg, total_steps=...)` from the config sections.
- `sft`: `laminar sft`.

Submodules are imported explicitly; this package imports nothing, so `laminar_jax.learner.sft`
can be found without loading JAX.
"""
