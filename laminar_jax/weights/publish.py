"""Publishing learner weights: orbax async saves into a versioned weight store (Laminar §4.2).

The learner calls `Publisher.publish(version, params)` after each update and goes back to
training. The call casts the params to the rollout dtype on their devices (sharding kept), then
hands them to an orbax `AsyncCheckpointer`, whose `save` blocks only for the device-to-host copy;
the file write runs in a background thread. When a write is finalized, the publisher tells the
master relay `publish(version, path)`; the master restores, converts and broadcasts (relay.py).

Superseding: relays need only the latest version, and the learner must never wait for a write.
The publisher owns two checkpointer slots. A new version takes an idle slot; if both are busy, the
younger of the two writes is cancelled (orbax `cancel()`, the slot gets a fresh checkpointer) and
the new version takes its place. The older write is never cancelled, so some version always
completes even when every write takes longer than a train step. A write that finishes after a
newer one was already announced is deleted unannounced ("publish_stale").

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
        """Removes a finalized version (and, with `temporary`, its unfinished orbax folders)."""
        shutil.rmtree(self.path(version), ignore_errors=True)
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


@dataclasses.dataclass(eq=False)
class _Write:
    """One version being written by one checkpointer."""

    version: int
    checkpointer: Any
    cancelled: bool = False
    watcher: threading.Thread | None = None

    def busy(self) -> bool:
        return self.watcher is not None and self.watcher.is_alive()


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
        self._lock = threading.Lock()
        self._master = master
        # Two slots: a checkpointer each and the write it is doing (None when never used).
        self._checkpointers = [self._new_checkpointer() for _ in range(2)]
        self._writes: list[_Write | None] = [None, None]
        self._watchers: list[threading.Thread] = []   # every write's, cancelled ones included
        self._cancelled: set[int] = set()
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
        with self._lock:
            return self._latest_written

    def publish(self, version: int, params: Any) -> None:
        """Starts publishing `params` as `version`; returns after the device-to-host copy."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"Publisher.publish: version must be an int >= 0, got {version!r}")
        if self._last_published is not None and version <= self._last_published:
            raise ValueError(f"Publisher.publish: version {version} is not newer than the last "
                             f"published version {self._last_published}")
        import orbax.checkpoint as ocp

        start = time.perf_counter()
        self._events("publish_start", version=version)
        tree = params.to_pure_dict() if hasattr(params, "to_pure_dict") else params
        cast = self._cast(tree)
        slot = self._free_slot(version)
        write = _Write(version, self._checkpointers[slot])
        self._writes[slot] = write
        # Blocks for the device-to-host copy only; the write continues in orbax's thread.
        write.checkpointer.save(self.store.path(version), args=ocp.args.PyTreeSave(cast))
        write.watcher = threading.Thread(target=self._finish, args=(write,),
                                         name=f"publish-v{version}", daemon=True)
        write.watcher.start()
        self._watchers = [w for w in self._watchers if w.is_alive()] + [write.watcher]
        self._last_published = version
        self._events("publish_returned", version=version, blocked_s=time.perf_counter() - start)

    def _free_slot(self, version: int) -> int:
        busy = _agree([w is not None and w.busy() for w in self._writes])
        if not all(busy):
            return busy.index(False)
        # Both writes still running: cancel the younger one; the older keeps going, so some
        # write always completes.
        slot = max(range(2), key=lambda i: self._writes[i].version)
        victim = self._writes[slot]
        victim.cancelled = True
        # A finished write needs no cancel (orbax then warns from a closed event loop), but only
        # a single process may skip it: the others could not know.
        if self._multi_process or not os.path.isdir(self.store.path(victim.version)):
            victim.checkpointer.cancel()
        self._checkpointers[slot] = self._new_checkpointer()
        self._events("publish_superseded", version=victim.version, by=version)
        return slot

    def _finish(self, write: _Write) -> None:
        """Watcher thread: waits for the write, then announces it (or cleans up)."""
        version = write.version
        try:
            write.checkpointer.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - surfaced as an event; the learner keeps going
            if not write.cancelled:
                self._events("publish_failed", version=version, error=repr(e))
        if write.cancelled or not os.path.isdir(self.store.path(version)):
            if write.cancelled:   # its checkpointer was replaced: release its threads now
                try:
                    write.checkpointer.close()
                except Exception:  # noqa: BLE001 - a cancelled write may fail to close cleanly
                    pass
            if self._primary:
                self.store.delete(version, temporary=True)
            with self._lock:
                self._cancelled.add(version)   # swept again once a newer version lands
            return
        with self._lock:
            stale = self._latest_written is not None and version < self._latest_written
            if not stale:
                self._latest_written = version
            master = self._master
            newest = self._latest_written
        if stale:
            if self._primary:
                self.store.delete(version)
            self._events("publish_stale", version=version, newer=newest)
            return
        self._events("publish_written", version=version, path=self.store.path(version))
        self._clean_cancelled(below=version)
        self._announce(master, version)

    def _clean_cancelled(self, below: int | None = None) -> None:
        # A cancelled orbax write can leave (or re-create, from its background threads) an empty
        # temporary folder after its watcher cleaned up; sweep them when a newer version lands.
        if not self._primary:
            return
        with self._lock:
            done = {v for v in self._cancelled if below is None or v < below}
            self._cancelled -= done
        for v in done:
            self.store.delete(v, temporary=True)

    def _announce(self, master: Any, version: int) -> None:
        if master is None or not self._primary:
            return
        master.publish.remote(version, self.store.path(version))
        self._events("publish_announced", version=version)

    def set_master(self, master: Any) -> None:
        """Points the publisher at a (new) master relay and re-announces the newest version."""
        with self._lock:
            self._master = master
            latest = self._latest_written
        if latest is not None and os.path.isdir(self.store.path(latest)):
            self._announce(master, latest)

    def wait_until_written(self, timeout_s: float = WRITE_TIMEOUT_S) -> None:
        """Blocks until every write in flight is complete and announced (tests, shutdown);
        TimeoutError naming the version when one takes longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for watcher in list(self._watchers):
            watcher.join(max(0.0, deadline - time.monotonic()))
            if watcher.is_alive():
                raise TimeoutError(f"Publisher: {watcher.name} still writing to {self.store.root} "
                                   f"after {timeout_s:.0f} s")

    def close(self) -> None:
        self.wait_until_written()
        self._clean_cancelled()
        for checkpointer in self._checkpointers:
            checkpointer.close()


def _agree(flags: list[bool]) -> list[bool]:
    """Slot-busy flags agreed by every learner process, so all hosts pick the same slot."""
    import jax
    if jax.process_count() == 1:
        return flags
    from jax.experimental import multihost_utils
    gathered = multihost_utils.process_allgather(np.asarray(flags, np.int32))
    return [bool(x) for x in np.asarray(gathered).reshape(-1, len(flags)).any(axis=0)]
