"""What one relay holds: the served version, the one arriving, and which of its chunks are in.

A relay serves one complete version and fills at most one arriving version (Laminar §4.2); chunks
of the arriving version come from the object store (the relay's loop) or from streams (receiver
threads), so every transition happens here, under one condition variable:

    claim(manifest, i)   chunk i of `manifest` is coming: None if it is not needed (an older
                         version, one rejected before, a chunk already in); a newer version
                         replaces the arriving one ("version_dropped"). A chunk being read from
                         one connection is "busy" for the others, so two streams never write the
                         same bytes at once. With `source` (a same-host upstream's shared buffer
                         holding the chunk), a new arrival adopts that buffer: the relays of one
                         host share the version's memory and each checks every chunk itself. An
                         adopted arrival turns private (its own buffer, a copy of what is in) as
                         soon as a chunk comes another way.
    accept(arrival, i)   chunk i passed its checks; True when it completes the version.
    serve(...)           the complete version becomes the served one.
    reject(...)          a bad chunk: the arriving version is dropped, the served one stays, and
                         later chunks of that version are ignored.

Version buffers come from `allocate` (a `shared_buffer.BufferPool`: memfd buffers that rollouts
and same-host relays map read-only) or are numpy arrays. A shared buffer is never reused, since a
rollout may still read it: serving a version releases the previous one's (no new mappings; the
memory goes with the last one), and the pool prepares the next buffer ahead. Numpy buffers are
copied into the object store to be served, so with streams the last completed arrival's buffer is
kept (`keep_spare`) and the next version is received into its already-mapped pages.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import numpy as np

from laminar_jax.weights import flat
from laminar_jax.weights.shared_buffer import SharedBuffer, drop_later

__all__ = ["Arrival", "Served", "Versions"]


@dataclasses.dataclass(eq=False)
class Arrival:
    manifest: flat.Manifest
    buffer: np.ndarray
    shared: SharedBuffer | None = None     # the buffer's memfd, when `buffer` is shared
    have: set[int] = dataclasses.field(default_factory=set)
    receiving: set[int] = dataclasses.field(default_factory=set)   # being read from a stream
    landed: set[int] = dataclasses.field(default_factory=set)      # read in full, maybe unchecked
    sending: int = 0            # forwards still queued on stream links (they read `buffer`)
    via: dict = dataclasses.field(default_factory=lambda: {"tcp": 0, "shared_memory": 0,
                                                                 "object_store": 0})
    # seconds this relay spent per step, reported with relay_received (where the time goes)
    timings: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(
        ("wait_s", "check_s", "copy_s", "forward_s"), 0.0))


@dataclasses.dataclass(eq=False)
class Served:
    """A complete version as this relay serves it: its buffer, and how rollouts read it (a
    shared buffer's handle, or an ObjectRef in this node's object store, made on demand for
    shared buffers)."""

    buffer: np.ndarray
    shared: SharedBuffer | None = None
    ref: Any = None


class Versions:
    """The served version (manifest, Served) and the arriving one of one relay."""

    def __init__(self, log: Callable[..., None], *, keep_spare: bool,
                 allocate: Callable[[int], SharedBuffer] | None = None):
        self.cond = threading.Condition()
        self.current: tuple[flat.Manifest, Served] | None = None
        self._allocate = allocate
        self.arriving: Arrival | None = None
        self._spare: Arrival | None = None
        self._keep_spare = keep_spare
        self._rejected = -1          # newest version dropped after a bad chunk
        self._log = log

    @property
    def current_version(self) -> int | None:
        return None if self.current is None else self.current[0].version

    def stale(self, version: int) -> bool:
        """This relay needs nothing of `version` (it serves it or newer, or rejected it)."""
        with self.cond:
            return ((self.current is not None and version <= self.current[0].version)
                    or version <= self._rejected)

    def claim(self, manifest: flat.Manifest, i: int, *, fits: bool | None = None,
              source: Any = None) -> tuple[Arrival, str] | None:
        """None if chunk `i` is not needed; else (arrival, state) with state "direct" (write it
        into `arrival.buffer`, then `done_receiving`; with a `source` the arrival may share it,
        and then the chunk is already in place), "busy" (it is being received on another
        connection) or "misfit" (it cannot be placed: check it, which rejects it)."""
        v = manifest.version
        with self.cond:
            if self.stale(v):
                return None
            arrival = self.arriving
            if arrival is None or arrival.manifest.version < v:
                if arrival is not None:
                    self._log("version_dropped", version=arrival.manifest.version, superseded_by=v)
                arrival = self.arriving = self._new_arrival(manifest, source)
            elif arrival.manifest.version > v or i in arrival.have:
                return None
            if manifest != arrival.manifest:
                self.reject(manifest, i, "manifest differs from the one of the arriving version")
                return None
            if not (0 <= i < manifest.num_chunks if fits is None else fits):
                return arrival, "misfit"
            if i in arrival.receiving:
                return arrival, "busy"
            shared = arrival.shared
            if shared is not None and not shared.writable and (
                    source is None or source.handle.inode != shared.handle.inode):
                self._privatize(arrival)
            arrival.receiving.add(i)
            return arrival, "direct"

    def _new_arrival(self, manifest: flat.Manifest, source: Any = None) -> Arrival:
        if source is not None and source.array.size == manifest.total_bytes:
            try:
                return Arrival(manifest, source.array, SharedBuffer.adopt(source.handle,
                                                                          source.array))
            except LookupError:     # released or not local after all: receive a copy
                pass
        if self._allocate is not None:
            shared = self._allocate(manifest.total_bytes)
            return Arrival(manifest, shared.array, shared)
        spare, self._spare = self._spare, None
        if (spare is not None and spare.buffer.size == manifest.total_bytes and spare.sending == 0
                and not spare.receiving):
            return Arrival(manifest, spare.buffer)
        return Arrival(manifest, np.empty(manifest.total_bytes, np.uint8))

    def _privatize(self, arrival: Arrival) -> None:
        """A chunk of an adopted arrival comes another way (bytes, or another buffer): copy what
        is in into a buffer of this relay's own and receive into that from now on."""
        if self._allocate is None:
            buffer, shared = np.empty(arrival.manifest.total_bytes, np.uint8), None
        else:
            shared = self._allocate(arrival.manifest.total_bytes)
            buffer = shared.array
        # chunks in `receiving` are chunk-at claims in place: their bytes are in the buffer too
        for j in arrival.have | arrival.landed | arrival.receiving:
            s, e = arrival.manifest.chunks[j]
            buffer[s:e] = arrival.buffer[s:e]
        adopted, arrival.buffer, arrival.shared = arrival.shared, buffer, shared
        adopted.release()
        self._log("version_privatized", version=arrival.manifest.version,
                  chunks=len(arrival.have | arrival.landed | arrival.receiving))

    def done_receiving(self, arrival: Arrival, i: int) -> bool:
        """Ends a "direct" claim; True if chunk `i` of `arrival` is still wanted."""
        with self.cond:
            arrival.receiving.discard(i)
            return self.arriving is arrival and i not in arrival.have

    def accept(self, arrival: Arrival, i: int, via: str) -> bool:
        """Chunk `i` passed its checks; True when it completes the version."""
        with self.cond:
            if self.arriving is not arrival or i in arrival.have:
                return False
            arrival.have.add(i)
            arrival.via[via] += 1
            return len(arrival.have) == arrival.manifest.num_chunks

    def serve(self, manifest: flat.Manifest, served: Served, arrival: Arrival | None) -> None:
        with self.cond:
            previous, self.current = self.current, (manifest, served)
            if previous is not None and previous[1].shared is not None:
                previous[1].shared.release()
                drop_later(previous)    # its pages are freed off this thread
                del previous
            if self.arriving is not None and self.arriving.manifest.version <= manifest.version:
                self.arriving = None
            if arrival is not None and self._keep_spare:
                self._spare = arrival
            self.cond.notify_all()

    def reject(self, manifest: flat.Manifest, i: int, reason: str) -> None:
        self._log("chunk_rejected", version=manifest.version, chunk=i, reason=reason)
        with self.cond:
            self._rejected = max(self._rejected, manifest.version)
            if self.arriving is not None and self.arriving.manifest.version <= manifest.version:
                self.arriving = None   # never the spare: a stream may still be writing into it
                self._log("version_aborted", version=manifest.version)

    def chunks_held(self, version: int) -> frozenset[int] | None:
        with self.cond:
            if self.stale(version):
                return None
            arrival = self.arriving
            if arrival is None or arrival.manifest.version != version:
                return frozenset()
            return frozenset(arrival.have)

    def wait_newer(self, version: int, timeout_s: float | None
                   ) -> tuple[flat.Manifest, Served] | None:
        with self.cond:
            self.cond.wait_for(lambda: self.current is not None
                               and self.current[0].version > version, timeout=timeout_s)
            current = self.current
        return current if current is not None and current[0].version > version else None

    def status(self) -> dict:
        with self.cond:
            arrival = self.arriving
            return {"version": self.current_version,
                    "arriving": None if arrival is None else arrival.manifest.version,
                    "arriving_chunks": 0 if arrival is None else len(arrival.have)}
