"""Rollout engines (JAX, vLLM) behind one protocol, and the rollout worker.

No JAX import at module level here except in `rollout.jax_engine` (and its `rollout.jax_weights`):
a GPU rollout node running vLLM must not need a JAX accelerator build.
"""
