"""Learner checkpoints: an orbax CheckpointManager under `<run_dir>/checkpoints/<version>/`.

Each checkpoint holds two items:
    state  the train state (params, optimizer state, step), sharded, async-saved by orbax
    meta   JSON: the weight version and the data actor's snapshot (prompt-pool cursor and ledger,
           buffered groups with their trajectories), so a resumed run neither loses a prompt
           group nor consumes one twice (laminar_jax.data.prompt_pool, "Checkpoint order")

A save is asynchronous: `save()` returns after the device-to-host copy and orbax writes and then
commits (renames its temporary folder to `<version>/`) in the background. `committed()` reports
the saves that have committed since it was last asked; only those count as checkpoints (the
learner logs its "checkpoint" event then, never for a save a crash cut short, and `latest()`
never returns an uncommitted one: orbax skips and, at the next start, removes temporary folders).
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any

import jax
import orbax.checkpoint as ocp


def checkpoint_due(version: int, *, last_version: int, last_time: float, now: float, every: int,
                   every_s: float, final_version: int) -> bool:
    """Whether the learner checkpoints after reaching `version`.

    Due when `every` > 0 and version % every == 0, or `every_s` > 0 and at least every_s seconds
    passed since the last checkpoint (or the run's start), or at the final version; never twice for
    one version. A crash then loses at most max(every steps, every_s seconds) of learner work.
    """
    if version <= last_version:
        return False
    if version >= final_version:
        return True
    if every and version % every == 0:
        return True
    return bool(every_s) and now - last_time >= every_s


class Checkpointer:
    """`save(version, state, meta)`, `committed()`, `latest()`, `restore(version, like_state)`."""

    def __init__(self, run_dir: str, *, max_to_keep: int = 2):
        self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        # saves a crash cut short: orbax never returns them, and its own cleanup runs in the background
        if os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                if ".orbax-checkpoint-tmp" in name:
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               cleanup_tmp_directories=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        self._pending: list[tuple[int, float]] = []  # (version, save start) not yet committed

    def latest(self) -> int | None:
        return self._mgr.latest_step()

    def save(self, version: int, state: Any, meta: dict) -> None:
        """Starts an async save (orbax blocks only for the device-to-host copy, and for the
        previous save if it is still writing)."""
        self._mgr.save(version, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
        self._pending.append((version, time.time()))

    def committed(self, *, wait: bool = False) -> list[dict]:
        """Saves committed since the last call: [{"version", "save_s", "path"}] (with `wait`, after
        waiting for the one in flight). A save orbax reports done but whose folder is missing
        (it failed) raises."""
        if not self._pending:
            return []
        if wait:
            self._mgr.wait_until_finished()
        elif self._mgr.is_saving_in_progress():
            # orbax saves one at a time: every save before the last one has committed
            done, self._pending = self._pending[:-1], self._pending[-1:]
            return [self._record(v, t0) for v, t0 in done]
        self._mgr.check_for_errors()
        done, self._pending = self._pending, []
        return [self._record(v, t0) for v, t0 in done]

    def _record(self, version: int, started: float) -> dict:
        path = os.path.join(self.directory, str(version))
        latest = self._mgr.latest_step()
        # missing and older than the latest: committed, then removed by max_to_keep
        if not os.path.isdir(path) and (latest is None or version >= latest):
            raise RuntimeError(f"checkpoint {version}: orbax reported it saved, but {path} is missing")
        return {"version": version, "save_s": time.time() - started, "path": path}

    def restore(self, version: int, like_state: Any) -> tuple[Any, dict]:
        """(state laid out like `like_state`, meta) of checkpoint `version`."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like_state)
        out = self._mgr.restore(version, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def close(self) -> list[dict]:
        """Waits for the save in flight; returns the saves committed since `committed()` last ran."""
        done = self.committed(wait=True)
        self._mgr.close()
        return done
