"""Learner checkpoints: an orbax CheckpointManager under `<run_dir>/checkpoints/<version>/`.

Each checkpoint holds two items:
    state  the train state (params, optimizer state, step), sharded, async-saved by orbax
    meta   JSON: the weight version and the data actor's snapshot (prompt-pool cursor and ledger,
           buffered groups with their trajectories), so a resumed run neither loses a prompt
           group nor consumes one twice (laminar_jax.data.prompt_pool, "Checkpoint order")
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """`save(version, state, meta)`, `latest()`, `restore(version, like_state)`."""

    def __init__(self, run_dir: str, *, max_to_keep: int = 2):
        self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest(self) -> int | None:
        return self._mgr.latest_step()

    def save(self, version: int, state: Any, meta: dict) -> None:
        """Starts an async save (orbax blocks only for the device-to-host copy)."""
        self._mgr.save(version, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, version: int, like_state: Any) -> tuple[Any, dict]:
        """(state laid out like `like_state`, meta) of checkpoint `version`."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like_state)
        out = self._mgr.restore(version, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()
