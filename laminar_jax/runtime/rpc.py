"""Re-export: `call` / `send` / `node_id` live in `rollout.rpc`, which the rollout worker uses
without importing the runtime (tests/rollout/test_layering.py)."""
from rollout.rpc import call, node_id, send  # noqa: F401
