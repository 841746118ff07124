"""The warm standby master: the next relay in line follows the weight store (Laminar §4.3).

A master that dies while it restores the newest version, or before its broadcast reached the
next relay, leaves that version only in the store. The relay promoted in its place used to
restore it then, on the failover's critical path (0.1-0.44 s measured; once 4x a typical
restore). The standby instead keeps the master's step ready ahead: on a thread at the lowest CPU
priority it restores each version committed to the store that it does not yet serve
(`master.prepare_pinned`: a hard-linked copy, so the master's prune never pulls files from
under it) into a buffer of its own, with its manifest, and drops it once the chain has brought
it that version (or a newer one). Promotion takes the prepared version (`take`): the new master
serves and broadcasts it without reading the store; if the follower is reading exactly that
version right then, promotion waits for that read instead of starting a second.

Following also keeps the standby warm (its first orbax restore, seconds of CPU more than later
ones, is paid ahead); `caught_up` (what `RelayGroup.standby_warm` reports) says it is warm and
has the store's newest version, served or prepared. The store must be visible from the
standby's process (the same host, or a shared file system); else it only imports what a master
needs. Visibility is judged once the relay serves a version: before the learner's first publish
the store's folder may not exist yet (judged at once, every standby named with the group gave up
for good as "not visible", and the first failover restored cold: 7-9x a normal broadcast).
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Callable

import numpy as np

from laminar_jax.weights import flat, master, shared_buffer

__all__ = ["Prepared", "Standby", "FOLLOW_POLL_S"]

FOLLOW_POLL_S = 0.05     # how often the follower lists the store (a tmpfs directory listing)
TAKE_WAIT_S = 30.0       # promotion waits at most this long for the follower's read in flight


@dataclasses.dataclass(eq=False)
class Prepared:
    """A version converted and checksummed as the master would, not served yet."""

    manifest: flat.Manifest
    buffer: np.ndarray
    shared: shared_buffer.SharedBuffer | None
    timings: dict


class Standby:
    """Follows `role.store` on a daemon thread until `stop()`.

    Args:
      role: the master role this relay would take (store, model config, chunking).
      served: the version this relay serves now (None: none).
      allocate: `n -> SharedBuffer` for the prepared buffers (None: numpy buffers).
      log: the relay's `(kind, **fields)` event sink.
      first_after: None: follow at once. Else the first read waits (up to wait_s) until
        `served()` is newer than this (-1: until it serves any): a standby named at a failover
        must not take cores (its reads) from the new master's first broadcast.
    """

    def __init__(self, role: master.MasterRole, *, served: Callable[[], int | None],
                 allocate: Callable[[int], shared_buffer.SharedBuffer] | None,
                 log: Callable[..., None], first_after: int | None, wait_s: float):
        self.role, self._served, self._allocate, self._log = role, served, allocate, log
        self._first_after, self._wait_s = first_after, wait_s
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.prepared: Prepared | None = None
        self._tid: int | None = None   # the follower thread (its priority is raised at promotion)
        self.reading: int | None = None    # the version being read now
        self.reads = 0                     # store reads (orbax restores) made by the follower
        self.warm = False
        # a committed version that failed to read (torn, corrupt) stays so: it is reported once
        # and skipped until a newer one is committed, not re-read every poll
        self.failed: int | None = None
        self._thread = threading.Thread(target=self._run, name="standby-follow", daemon=True)

    def start(self) -> "Standby":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 0.0) -> None:
        """No read starts after this; waits up to timeout_s for the one in flight."""
        self._stop.set()
        if timeout_s > 0 and self._thread.is_alive():
            self._thread.join(timeout_s)

    def take(self, version: int, wait_s: float = TAKE_WAIT_S) -> Prepared | None:
        """Stops following and hands over the prepared `version` (waiting for its read when
        that is in flight); None when the follower has not got it."""
        self._stop.set()
        with self._cond:
            if self.reading == version:   # the new master waits on it: no more lowest priority
                _normal_priority(self._tid)
            self._cond.wait_for(lambda: self.reading != version, timeout=wait_s)
            prepared, self.prepared = self.prepared, None
        if prepared is not None and prepared.manifest.version == version:
            return prepared
        _release(prepared)
        return None

    def caught_up(self) -> bool:
        """Warm, no read in flight, and the store's newest version is served here or prepared:
        a promotion now needs no store read (and no cold one for the next version)."""
        served = self._served()
        with self._cond:
            prepared, reading = self.prepared, self.reading
        if not self.warm or reading is not None:
            return False
        versions = self.role.store.versions()
        have = max(-1 if served is None else served, -1 if prepared is None else prepared.manifest.version)
        return not versions or versions[-1] <= have

    # ------------------------------------------------------------------ the follower
    def _visible(self) -> bool:
        return os.path.isdir(self.role.store.root)

    def _wait_first(self, deadline: float) -> bool:
        """Waits (until `deadline`) for the relay to serve a version newer than `first_after`
        (named at a failover), and for the store to be visible; False: give up."""
        while not self._stop.is_set():
            served, late = self._served(), time.monotonic() >= deadline
            if late or self._first_after is None or (served is not None and served > self._first_after):
                if self._visible():
                    return True
                if served is not None or late:   # it serves a version: the store holds one
                    self._log("standby_ready", warmed=False, error="weight store not visible from this relay")
                    return False
            self._stop.wait(FOLLOW_POLL_S if self._first_after is None else 0.5)
        return False

    def _run(self) -> None:
        # imports at normal priority: the loop thread of a master elected meanwhile waits for
        # them (the import lock), and must not wait on a thread that gets no CPU
        import orbax.checkpoint  # noqa: F401
        from laminar_jax.weights import publish  # noqa: F401
        self._tid = threading.get_native_id()
        if not self._wait_first(time.monotonic() + self._wait_s):
            return
        while not self._stop.is_set():
            self._follow_once()
            if self.warm:   # the warm-up read ran at normal priority, as a promotion's would
                shared_buffer.background_priority()
            self._stop.wait(FOLLOW_POLL_S)

    def _follow_once(self) -> None:
        served = self._served()
        served = -1 if served is None else served
        with self._cond:
            prepared = self.prepared
            if prepared is not None and prepared.manifest.version <= served:
                self.prepared = None   # the chain brought it: promotion needs no copy of it
                _release(prepared)
                prepared = None
        versions = self.role.store.versions()
        newest = versions[-1] if versions else None
        have = max(served, -1 if prepared is None else prepared.manifest.version)
        # the first read warms the follower (orbax, the conversion, the page cache) even when
        # the chain already delivered the newest version: a promotion then restores warm
        if newest is None or self._stop.is_set() or (newest <= have and self.warm) or newest == self.failed:
            return
        with self._cond:
            self.reading = newest
        got, error, shared = None, None, []
        try:
            def allocate(nbytes: int) -> np.ndarray:
                shared.append(self._allocate(nbytes))
                return shared[-1].array
            got = master.prepare_pinned(self.role, newest,
                                        allocate=None if self._allocate is None else allocate)
        except Exception as e:  # noqa: BLE001 - a bad version: the master reports it too
            error = e
        with self._cond:
            self.reading = None
            if got is not None:
                self.reads += 1
                manifest, buffer, timings = got
                old, self.prepared = self.prepared, Prepared(manifest, buffer, shared[0] if shared else None,
                                                             timings)
                _release(old)
            self._cond.notify_all()
        if got is None:
            for buf in shared:
                buf.release()
            if error is not None:
                self.failed = newest
                self._log("standby_error", version=newest, error=repr(error))
            return
        if not self.warm:
            self.warm = True
            self._log("standby_ready", warmed=True, version=newest, **got[2])
        self._log("standby_prepared", version=newest, **got[2])


def _normal_priority(tid: int | None) -> None:
    if tid is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 0)
    except (AttributeError, OSError):   # lowering a nice value needs CAP_SYS_NICE
        pass


def _release(prepared: Prepared | None) -> None:
    if prepared is not None and prepared.shared is not None:
        prepared.shared.release()
        shared_buffer.drop_later(prepared)
