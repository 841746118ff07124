"""Re-export: the weight sources live in `laminar_jax.weights.source`, below both the runtime and
`rollout/` (a rollout needs no runtime module; tests/rollout/test_layering.py keeps it so)."""
from laminar_jax.weights.source import (FAILOVER_GRACE_S, FAILOVER_RETRY_S, STORE_POLL_S,  # noqa: F401
                                        WATCH_POLL_S, RelaySource, StoreSource, WeightSource)
