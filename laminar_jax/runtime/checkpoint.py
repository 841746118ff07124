"""Learner checkpoints: an orbax CheckpointManager under `<run_dir>/checkpoints/<version>/`.

Each checkpoint holds two items:
    state  the train state (params, optimizer state, step), sharded, async-saved by orbax
    meta   JSON: the weight version and the data actor's snapshot (prompt-pool cursor and ledger,
           buffered groups with their trajectories), so a resumed run neither loses a prompt
           group nor consumes one twice (laminar_jax.data.prompt_pool, "Checkpoint order")

A save is asynchronous: `save()` returns after the device-to-host copy, and orbax writes and then
commits in the background, by renaming its temporary folder to `<version>/`. Only a committed save
counts as a checkpoint: a watcher thread sees the rename and calls `on_commit` (the learner logs
its "checkpoint" event then, never for a save a crash cut short), and `latest()` never returns an
uncommitted one (temporary folders are skipped, and removed at the next start).

Every save holds the process's orbax save slot (`laminar_jax.orbax_saves`) from before orbax's
`save` until its commit: the publisher's writer thread saves weight versions in this process
too, and two orbax saves at once in one process hang each other's commits. A commit thread waits
for the save and gives the slot back, so `save()` still returns after the device-to-host copy
(and after the publisher's write in progress, if any).
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from laminar_jax import orbax_saves


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

    def __init__(self, run_dir: str, *, max_to_keep: int = 2, on_commit: Callable[[dict], None] | None = None,
                 poll_s: float = 0.1):
        self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        # saves a crash cut short: orbax never returns them, and its own cleanup runs in the background;
        # with several learner hosts (one shared folder) only the primary removes them
        if os.path.isdir(self.directory) and jax.process_index() == 0:
            for name in os.listdir(self.directory):
                if ".orbax-checkpoint-tmp" in name:
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               cleanup_tmp_directories=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        self._pending: list[tuple[int, float]] = []  # (version, save start) not yet committed
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._on_commit, self._poll_s = on_commit, poll_s
        self._watcher: threading.Thread | None = None
        self._committer: threading.Thread | None = None   # holds the save slot until the commit

    def latest(self) -> int | None:
        return self._mgr.latest_step()

    def save(self, version: int, state: Any, meta: dict) -> None:
        """Starts an async save (orbax blocks only for the device-to-host copy, and for the
        previous save, or a weight version being published, if it is still writing)."""
        slot = orbax_saves.acquire(f"checkpoint {version} of {self.directory}")
        try:
            self._mgr.save(version, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            meta=ocp.args.JsonSave(meta)), force=True)
        except BaseException:
            slot.release()
            raise
        self._committer = threading.Thread(target=self._release_on_commit, args=(slot,),
                                           name=f"checkpoint-{version}-commit", daemon=True)
        self._committer.start()
        with self._lock:
            self._pending.append((version, time.time()))
        if self._on_commit is not None and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="checkpoint-commits", daemon=True)
            self._watcher.start()

    def _release_on_commit(self, slot: orbax_saves.SaveSlot) -> None:
        # A failed save also gives the slot back; `committed(wait=True)` raises its error.
        try:
            self._mgr.wait_until_finished()
        except Exception:  # noqa: BLE001 - surfaced by committed(wait=True) / check_for_errors
            pass
        finally:
            slot.release()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            for rec in self.committed():
                self._on_commit(rec)

    def committed(self, *, wait: bool = False) -> list[dict]:
        """Saves committed since the last call: [{"version", "save_s", "path"}]. A save counts when
        its folder has its final name (orbax's commit). With `wait`, first waits for the save in
        flight; one still missing then (a failed save) raises."""
        if wait:
            self._mgr.wait_until_finished()
            committer = self._committer
            if committer is not None:   # the slot is free again once this returns
                committer.join()
            self._mgr.check_for_errors()
        with self._lock:
            latest = max((v for v, _ in self._pending), default=None)
            done = [(v, t0) for v, t0 in self._pending
                    if os.path.isdir(self._path(v)) or (latest is not None and v < latest and wait)]
            if wait and len(done) < len(self._pending):
                missing = [v for v, t0 in self._pending if (v, t0) not in done]
                raise RuntimeError(f"checkpoints {missing}: orbax finished, but {self.directory} lacks them")
            self._pending = [p for p in self._pending if p not in done]
        return [{"version": v, "save_s": time.time() - t0, "path": self._path(v)} for v, t0 in done]

    def _path(self, version: int) -> str:
        return os.path.join(self.directory, str(version))

    def restore(self, version: int, like_state: Any) -> tuple[Any, dict]:
        """(state laid out like `like_state`, meta) of checkpoint `version`."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like_state)
        out = self._mgr.restore(version, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def close(self) -> list[dict]:
        """Waits for the save in flight; returns the commits the watcher has not reported."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        done = self.committed(wait=True)
        self._mgr.close()
        return done
