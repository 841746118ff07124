"""Publishing learner weights: orbax async saves into a versioned weight store (Laminar §4.2).

The learner calls `Publisher.publish(version, params)` after each update and goes back to
training. The call casts the params to the rollout dtype on their devices and copies them to host
numpy (the next update donates their buffers); that is all it waits for. A writer thread then
runs the orbax save (its synchronous part too: directory set-up, metadata, thread start, which
blocked the step loop 0.26-0.39 s per version under load) and, once orbax has committed the
version, tells the master relay `publish(version, path)`; the master restores, converts and
broadcasts (relay.py).

Superseding: relays need only the latest version, and the learner must never wait for a write.
One writer thread writes one version at a time, in version order, so a write is never torn or
overlapped by the next; a version still queued when a newer one arrives is dropped unwritten
("publish_superseded"). The write in progress is never cancelled, so some version always
completes even when every write takes longer than a train step. A failed write is reported
("publish_failed") and the next version is written as usual. Several learner processes: every
host saves every version in order (orbax's saves join cross-host barriers), in the step loop,
after the previous write has finished.

Each write holds the process's orbax save slot (`laminar_jax.orbax_saves`) from before orbax's
`save` until its commit, and so does the learner's checkpoint: orbax numbers saves from a
process-wide counter, and two saves at once in two threads of one process hang each other's
commits (CI: the learner's checkpoint waited 300 s for a signalling key). A version waiting for
the slot behind a checkpoint is replaced by a newer one queued meanwhile.

Weight store: `root/v{version:010d}/` (orbax's own layout; orbax writes into a temporary folder
and renames it when complete, so a `v...` folder is always whole). By default `root` is a fresh
folder on tmpfs (/dev/shm) of the learner's node; pass a shared path (network file system, or an
object store path orbax supports) with `shared=True` when the learner spans several hosts. The
master prunes every version older than the one it has just taken; the newest is kept so that a
master elected after a failure can restore it again.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np

from laminar_jax import orbax_saves

__all__ = ["WeightStore", "Publisher", "read_path", "read_version", "prune_store"]

_VERSION_DIR = re.compile(r"^v(\d{10})$")
# orbax's temporaries, and the folder the hosts of a multi-host learner write into (host_shards)
_TMP_DIR = re.compile(r"^v(\d{10})\.(orbax-checkpoint-tmp|hosts-tmp)")


def _current_node_id() -> str | None:
    try:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - no Ray runtime: the store is simply not tied to a node
        return None


@dataclasses.dataclass(frozen=True)
class WeightStore:
    """Where published versions live.

    Args:
      root: folder holding `v{version:010d}` checkpoints.
      node_id: Ray node whose file system holds `root` (None: every node can read it).
      shared: True when `root` is reachable from every node (network FS / object store).
    """

    root: str
    node_id: str | None = None
    shared: bool = False

    @classmethod
    def local(cls, root: str | None = None) -> "WeightStore":
        """A store on this node: tmpfs (/dev/shm) when present, else the temp dir."""
        if root is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            root = os.path.join(base, f"laminar-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(root, exist_ok=True)
        return cls(root=os.path.abspath(root), node_id=_current_node_id(), shared=False)

    def path(self, version: int) -> str:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weight store {self.root}: version must be an int >= 0, got {version!r}")
        return os.path.join(self.root, f"v{version:010d}")

    def versions(self) -> list[int]:
        """Finalized versions, ascending."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _VERSION_DIR.match(n)))

    def readable_from(self, node_id: str | None) -> bool:
        return self.shared or self.node_id is None or node_id is None or node_id == self.node_id

    def delete(self, version: int, *, temporary: bool = False) -> None:
        """Removes a finalized version (and, with `temporary`, its unfinished orbax folders).

        The folder is renamed first (atomic), then removed: a reader pinning it meanwhile
        (`master.pin`) either linked every file before the rename or fails, never holds a
        copy with files missing. A prune killed between the two leaves `v...pruned-{pid}`,
        which the next prune on this host removes (`master.prune`)."""
        path = self.path(version)
        gone = f"{path}.pruned-{os.getpid()}"
        shutil.rmtree(gone, ignore_errors=True)   # left by a killed prune whose pid was reused
        try:
            os.rename(path, gone)
        except FileNotFoundError:   # pruned already
            pass
        shutil.rmtree(gone, ignore_errors=True)
        if temporary:
            for name in os.listdir(self.root):
                m = _TMP_DIR.match(name)
                if m and int(m.group(1)) == version:
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)


def _restore_numpy(path: str) -> dict:
    """Orbax checkpoint -> pure dict of host numpy arrays, whatever mesh wrote it.

    Restoring as np.ndarray needs no target sharding, so it works in a 1-device relay process for
    a checkpoint written by an 8-device learner. A multi-host learner's version (per-host shards
    and manifests) is assembled and checksummed by `host_shards.assemble`.
    """
    from laminar_jax.weights import host_shards
    if host_shards.is_host_sharded(path):
        return host_shards.assemble(path)
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(path).item_metadata
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta,
                                is_leaf=lambda x: hasattr(x, "shape"))
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))


STORE_READ_TIMEOUT_S = 300.0
WRITE_TIMEOUT_S = 600.0   # Publisher.wait_until_written: one version's write to the store


def _on_store_node(store: WeightStore, fn: Callable, *args):
    """Runs `fn(*args)` here if this node can read the store, else in a task pinned to its node."""
    if store.readable_from(_current_node_id()):
        return fn(*args)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    task = ray.remote(num_cpus=0, runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}})(fn)
    strategy = NodeAffinitySchedulingStrategy(store.node_id, soft=False)
    return ray.get(task.options(scheduling_strategy=strategy).remote(*args), timeout=STORE_READ_TIMEOUT_S)


def read_path(store: WeightStore, path: str) -> dict:
    """Host numpy params of the checkpoint at `path` in `store` (read through the store's node
    when this node cannot see it). A path this process sees (another node of the same host, or
    a shared file system) is read directly: a task on the store's node may need a new worker
    process first, seconds a master failover should not wait. The store root is unique per
    learner process (pid + uuid), so a visible path is the store's."""
    if os.path.isdir(path):
        return _restore_numpy(path)
    return _on_store_node(store, _restore_numpy, path)


def read_version(store: WeightStore, version: int) -> dict:
    """Host numpy params of a published version."""
    return read_path(store, store.path(version))


def _prune(store: WeightStore, keep_from: int) -> list[int]:
    removed = [v for v in store.versions() if v < keep_from]
    for v in removed:
        store.delete(v)
    return removed


def prune_store(store: WeightStore, keep_from: int) -> list[int]:
    """Deletes finalized versions older than `keep_from`; returns them."""
    return _on_store_node(store, _prune, store, keep_from)


def check_next_version(who: str, version: Any, last: int | None) -> None:
    """ValueError unless `version` is an int >= 0 newer than `last` (None: nothing published yet)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"{who}: version must be an int >= 0, got {version!r}")
    if last is not None and version <= last:
        raise ValueError(f"{who}: version {version} is not newer than the last published version {last}")


class Publisher:
    """Learner side of the weight path. One per learner process (every host of a multi-host
    learner makes the same calls; orbax writes each host's shards).

    Args:
      store: the weight store.
      dtype: rollout dtype the params are cast to before saving ("bfloat16", "float32", ...).
      master: the master relay (an actor handle with `publish.remote(version, path)`), or None
        until `set_master` is called.
      events: `(kind, **fields)` sink (e.g. `events.EventLog`), or None.
    """

    def __init__(self, store: WeightStore, *, dtype: str = "bfloat16", master: Any = None,
                 events: Callable[..., None] | None = None):
        import jax
        import jax.numpy as jnp

        self.store = store
        self.dtype = str(jnp.dtype(dtype))
        self._events = events or (lambda kind, **fields: None)
        self._cond = threading.Condition()
        self._master = master
        # One checkpointer, used by the writer thread only: one write at a time, in version order
        self._checkpointer = self._new_checkpointer()
        # (version, host tree | None, save slot | None) not started yet; multi-process jobs were
        # started in the step loop, holding the process's orbax save slot
        self._queue: list[tuple[int, Any, Any]] = []
        self._writing: int | None = None
        self._closed = False
        self._writer: threading.Thread | None = None
        self._last_published: int | None = None
        self._latest_written: int | None = None
        # One process announces and cleans the store; every process must take the same decisions.
        self._primary = jax.process_index() == 0
        self._multi_process = jax.process_count() > 1
        target = jnp.dtype(dtype)
        self._cast = jax.jit(lambda tree: jax.tree.map(lambda x: x.astype(target), tree))

    @staticmethod
    def _new_checkpointer():
        import jax
        if jax.process_count() > 1:   # each host writes its own shards and manifest (no gather)
            from laminar_jax.weights.host_shards import HostShardWriter
            return HostShardWriter()
        import orbax.checkpoint as ocp
        # No zstd: on tmpfs it only costs time (4x slower writes, 1.5x slower reads here).
        return ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))

    @property
    def latest_written(self) -> int | None:
        """Newest version whose write is complete in the store."""
        with self._cond:
            return self._latest_written

    def publish(self, version: int, params: Any) -> None:
        """Starts publishing `params` as `version`; returns after the device-to-host copy."""
        check_next_version("Publisher.publish", version, self._last_published)
        import jax
        import orbax.checkpoint as ocp

        start = time.perf_counter()
        self._events("publish_start", version=version)
        tree = params.to_pure_dict() if hasattr(params, "to_pure_dict") else params
        cast = self._cast(tree)
        if self._multi_process:
            # Every host writes its shards of every version (host_shards: host 0 finalises once
            # all manifests are in), so all hosts start each version in the same order, here,
            # once the writer thread has finished waiting for the previous one.
            self.wait_until_written()
            slot = orbax_saves.acquire(f"publish v{version} to {self.store.root}")
            try:
                self._checkpointer.save(self.store.path(version), args=ocp.args.PyTreeSave(cast))
            except BaseException:
                slot.release()
                raise
            job = (version, None, slot)
        else:
            # The device-to-host copy, owned by numpy: the next update donates (reuses) the
            # params' buffers, and the cast can return them unchanged (same dtype).
            job = (version, jax.tree.map(np.array, cast), None)
        with self._cond:
            if not self._multi_process:   # relays need only the newest: drop unstarted ones
                for old, _, _ in self._queue:
                    self._events("publish_superseded", version=old, by=version)
                self._queue.clear()
            self._queue.append(job)
            self._cond.notify_all()
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="publish-writer", daemon=True)
                self._writer.start()
        self._last_published = version
        self._events("publish_returned", version=version, blocked_s=time.perf_counter() - start)

    def _write_loop(self) -> None:
        """Writer thread: the orbax save of each queued version, then its announcement."""
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                version, tree, slot = self._queue.pop(0)
                self._writing = version
            try:
                if slot is None:
                    # One orbax save at a time in this process (the learner's checkpoint may be
                    # committing); a version queued meanwhile is newer: write that one instead.
                    slot = orbax_saves.acquire(f"publish v{version} to {self.store.root}")
                    version, tree = self._newest_after_wait(version, tree)
                self._write(version, tree)
            except Exception as e:  # noqa: BLE001 - an event sink or master call failed: keep writing
                self._events("publish_failed", version=version, error=repr(e))
            finally:
                if slot is not None:   # held until orbax committed (or gave up on) the version
                    slot.release()
                with self._cond:
                    self._writing = None
                    self._cond.notify_all()

    def _newest_after_wait(self, version: int, tree: Any) -> tuple[int, Any]:
        with self._cond:
            if not self._queue:
                return version, tree
            newest, newest_tree, _ = self._queue.pop()
            for old, _, _ in [(version, None, None)] + self._queue:
                self._events("publish_superseded", version=old, by=newest)
            self._queue.clear()
            self._writing = newest
        return newest, newest_tree

    def _write(self, version: int, tree: Any) -> None:
        import orbax.checkpoint as ocp

        path = self.store.path(version)
        try:
            if tree is not None:
                self._checkpointer.save(path, args=ocp.args.PyTreeSave(tree))
            self._checkpointer.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - surfaced as an event; the learner keeps going
            self._events("publish_failed", version=version, error=repr(e))
        if not os.path.isdir(path):   # failed: orbax's temporary folder goes, nothing is announced
            if self._primary:
                self.store.delete(version, temporary=True)
            return
        with self._cond:
            self._latest_written = version
            master = self._master
        self._events("publish_written", version=version, path=path)
        self._announce(master, version)

    def _announce(self, master: Any, version: int) -> None:
        if master is None or not self._primary:
            return
        master.publish.remote(version, self.store.path(version))
        self._events("publish_announced", version=version)

    def set_master(self, master: Any) -> None:
        """Points the publisher at a (new) master relay and re-announces the newest version."""
        with self._cond:
            self._master = master
            latest = self._latest_written
        if latest is not None and os.path.isdir(self.store.path(latest)):
            self._announce(master, latest)

    def wait_until_written(self, timeout_s: float = WRITE_TIMEOUT_S) -> None:
        """Blocks until every queued write is complete and announced (tests, shutdown);
        TimeoutError naming the version when one takes longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._writing is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    stuck = self._writing if self._writing is not None else self._queue[0][0]
                    raise TimeoutError(f"Publisher: publish-v{stuck} still writing to {self.store.root} "
                                       f"after {timeout_s:.0f} s")
                self._cond.wait(left)

    def close(self) -> None:
        self.wait_until_written()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(WRITE_TIMEOUT_S)
        self._checkpointer.close()
