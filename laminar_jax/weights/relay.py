"""RelayWorker: one per node, holds the latest weights in host memory (Laminar §4, Fig 6, Fig 7).

A relay is a Ray actor (threaded, CPU only) with one loop thread that handles its inbox in order:

    publish(version, path)   master only: `master.prepare` (restore the orbax checkpoint to host
                             numpy, engine layout, k checksummed chunks), send every chunk
                             downstream, serve the version, prune the weight store.
    chunk(manifest, i, ref)  from upstream: fetch, forward to the downstream relay(s) at once
                             (cut-through), check length and crc32, copy into the arriving
                             buffer, and serve the version when all k chunks are in. A bad chunk
                             is rejected and the arriving version dropped; the previous version
                             stays served.
    relink(downstream)       after a failure: ask each new downstream which chunks it lacks and
                             send them from the current and the arriving version.

Pipelining: `offer` starts fetching a chunk from the upstream node as soon as it is offered (a
small prefetch pool), so the loop checks and forwards chunk i while chunk i+1 is in transit.
Each forwarded chunk is a new object in this node's object store (`ray.put`), owned here, so the
next relay pulls it from this node and not from anywhere up the chain.

Rollouts call `latest()` (answers at once) or `wait_newer(version, timeout_s)`; both return a
`Snapshot(version, buffer, index)` whose `buffer` is an ObjectRef to the whole flat buffer in this
node's object store: `ray.get` on the same node maps it without copying (`pull` below). A relay
holds the current version and at most one arriving version.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from typing import Any

import numpy as np
import ray

from laminar_jax.weights import flat, master
from laminar_jax.weights.events import record

__all__ = ["RelayWorker", "Snapshot", "pull"]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A complete version as served: `buffer` is an ObjectRef to the uint8 flat buffer."""

    version: int
    buffer: Any
    index: tuple[flat.TensorEntry, ...]


@dataclasses.dataclass(eq=False)
class _Arriving:
    manifest: flat.Manifest
    buffer: np.ndarray
    have: set[int] = dataclasses.field(default_factory=set)
    # seconds this relay spent per step, reported with relay_received (where the time goes)
    timings: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(
        ("wait_s", "check_s", "copy_s", "forward_s"), 0.0))


class RelayWorker:
    """Relay actor body; create with `ray.remote(RelayWorker).options(max_concurrency=...)`.

    Args:
      name: this relay's id in the chain (the node id).
      fetch_timeout_s: how long one chunk fetch may take before it counts as lost.
      prefetch: chunks fetched ahead of the loop.
    """

    def __init__(self, name: str, *, fetch_timeout_s: float = 120.0, prefetch: int = 2):
        self.name = name
        self._fetch_timeout_s = fetch_timeout_s
        self._fetcher = concurrent.futures.ThreadPoolExecutor(prefetch, thread_name_prefix="fetch")
        self._inbox: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._events: list[dict] = []
        self._current: tuple[flat.Manifest, Any] | None = None   # (manifest, ObjectRef)
        self._arriving: _Arriving | None = None
        self._rejected = -1          # newest version dropped after a bad chunk
        self._announced = -1         # master: newest version announced by the publisher
        self._down: tuple = ()
        self._role: master.MasterRole | None = None
        self._pending: list = []     # results of offers sent downstream, reaped as they finish
        self._hold_after: int | None = None
        self._forwarded = 0
        self._released = threading.Event()
        self._loop_thread = threading.Thread(target=self._loop, name="relay-loop", daemon=True)
        self._loop_thread.start()

    # ------------------------------------------------------------------ remote API
    def ping(self) -> str:
        return self.name

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def configure_master(self, role: master.MasterRole) -> None:
        self._role = role

    def set_downstream(self, downstream: list) -> None:
        """New downstream relay handles (one in a chain, all others for a fan-out master)."""
        self._inbox.put(("relink", (tuple(downstream),)))

    def publish(self, version: int, path: str) -> None:
        """From the publisher: `version` is complete in the weight store at `path`."""
        with self._cond:
            self._announced = max(self._announced, version)
        self._inbox.put(("publish", (version, path)))

    def offer(self, manifest: flat.Manifest, chunk: int, refs: list) -> None:
        """From upstream: chunk `chunk` of `manifest.version` is `refs[0]` (a list, so Ray
        passes the ref instead of the bytes). The fetch starts now."""
        fetch = self._fetcher.submit(ray.get, refs[0], timeout=self._fetch_timeout_s)
        self._inbox.put(("chunk", (manifest, chunk, fetch)))

    def latest(self) -> Snapshot | None:
        with self._cond:
            return self._snapshot()

    def wait_newer(self, version: int, timeout_s: float | None = None) -> Snapshot | None:
        """The first complete version newer than `version`, or None after `timeout_s`."""
        with self._cond:
            self._cond.wait_for(lambda: self._current is not None
                                and self._current[0].version > version, timeout=timeout_s)
            snap = self._snapshot()
        return snap if snap is not None and snap.version > version else None

    def chunks_held(self, version: int) -> frozenset[int] | None:
        """Chunks of `version` already accepted here, or None when this relay needs none of
        them (it serves this version or a newer one, or dropped it after a bad chunk)."""
        with self._cond:
            if self._current is not None and self._current[0].version >= version:
                return None
            if version <= self._rejected:
                return None
            arriving = self._arriving
        if arriving is None or arriving.manifest.version != version:
            return frozenset()
        return frozenset(arriving.have)

    def status(self) -> dict:
        with self._cond:
            arriving = self._arriving
            return {
                "name": self.name,
                "master": self._role is not None,
                "version": None if self._current is None else self._current[0].version,
                "arriving": None if arriving is None else arriving.manifest.version,
                "arriving_chunks": 0 if arriving is None else len(arriving.have),
                "downstream": len(self._down),
            }

    def drain_events(self) -> list[dict]:
        with self._cond:
            out, self._events = self._events, []
        return out

    def hold(self, after_chunks: int) -> None:
        """Fault drill: stop forwarding after `after_chunks` more chunks until `release()`."""
        self._released.clear()
        self._hold_after = self._forwarded + after_chunks

    def release(self) -> None:
        self._hold_after = None
        self._released.set()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        handlers = {"publish": self._on_publish, "chunk": self._on_chunk, "relink": self._on_relink}
        while True:
            kind, args = self._inbox.get()
            try:
                handlers[kind](*args)
            except Exception as e:  # noqa: BLE001 - a relay must survive one bad message
                self._log("relay_error", message=kind, error=repr(e))

    def _on_publish(self, version: int, path: str) -> None:
        role = self._role
        if role is None:
            self._log("relay_error", message="publish", error="not the master", version=version)
            return
        with self._cond:
            current = None if self._current is None else self._current[0].version
            announced = self._announced
        if current is not None and version <= current:
            return
        if version < announced:   # a newer version is already queued: relays need only the latest
            self._log("publish_skipped", version=version, newer=announced)
            return
        manifest, buffer, timings = master.prepare(role, version, path)
        self._log("master_restored", version=version, bytes=int(buffer.size),
                  chunks=manifest.num_chunks, **timings)
        clock = time.perf_counter()
        for i, (s, e) in enumerate(manifest.chunks):
            self._forward(manifest, i, buffer[s:e])
        self._complete(manifest, buffer, forward_s=time.perf_counter() - clock)
        pruned = master.prune(role, version)
        if pruned:
            self._log("store_pruned", versions=pruned)

    def _on_chunk(self, manifest: flat.Manifest, i: int, fetch: concurrent.futures.Future) -> None:
        v = manifest.version
        with self._cond:
            if (self._current is not None and v <= self._current[0].version) or v <= self._rejected:
                fetch.cancel()
                return
        arriving = self._arriving
        if arriving is None or arriving.manifest.version < v:
            if arriving is not None:
                self._log("version_dropped", version=arriving.manifest.version, superseded_by=v)
            arriving = self._arriving = _Arriving(manifest, np.empty(manifest.total_bytes, np.uint8))
        elif arriving.manifest.version > v or i in arriving.have:
            fetch.cancel()
            return
        if manifest != arriving.manifest:
            self._reject(manifest, i, "manifest differs from the one of the arriving version")
            return
        clock, timings = time.perf_counter(), arriving.timings
        try:
            data = fetch.result()
        except Exception as e:  # noqa: BLE001 - upstream died or the object is gone
            # The relink after the failure resends what is missing.
            self._log("chunk_lost", version=v, chunk=i, error=type(e).__name__)
            return
        clock = _tick(timings, "wait_s", clock)
        # Cut-through: pass the chunk on before checking it, so a hop adds a fetch and a put to
        # the pipeline, not the checksum and the copy too. Every relay checks against the
        # master's checksums itself, so a damaged chunk is rejected wherever it arrives.
        self._forward(manifest, i, data)
        clock = _tick(timings, "forward_s", clock)
        problem = flat.check_chunk(manifest, i, data)
        if problem is not None:
            self._reject(manifest, i, problem)
            return
        clock = _tick(timings, "check_s", clock)
        s, e = manifest.chunks[i]
        arriving.buffer[s:e] = data
        del data
        arriving.have.add(i)
        _tick(timings, "copy_s", clock)
        if len(arriving.have) == manifest.num_chunks:
            self._complete(manifest, arriving.buffer, **timings)

    def _on_relink(self, downstream: tuple) -> None:
        self._down = downstream
        sources = []
        with self._cond:
            if self._current is not None:
                sources.append((self._current[0], ray.get(self._current[1]), None))
        if self._arriving is not None:
            sources.append((self._arriving.manifest, self._arriving.buffer, self._arriving.have))
        for relay in downstream:
            for manifest, buffer, have in sources:
                try:
                    held = ray.get(relay.chunks_held.remote(manifest.version), timeout=30)
                except Exception as e:  # noqa: BLE001 - the group's next heartbeat handles it
                    self._log("relay_error", message="relink", error=repr(e))
                    break
                if held is None:
                    continue
                needed = [i for i in range(manifest.num_chunks)
                          if i not in held and (have is None or i in have)]
                if needed:
                    self._log("relay_resend", version=manifest.version, chunks=len(needed))
                for i in needed:
                    s, e = manifest.chunks[i]
                    self._send(relay, manifest, i, ray.put(buffer[s:e]))

    # ------------------------------------------------------------------ helpers
    def _forward(self, manifest: flat.Manifest, i: int, data: np.ndarray) -> None:
        if self._hold_after is not None and self._forwarded >= self._hold_after:
            self._released.wait()
        self._forwarded += 1
        if not self._down:
            return
        ref = ray.put(data)   # owned by this relay: the next hop pulls from this node
        for relay in self._down:
            self._send(relay, manifest, i, ref)

    def _send(self, relay: Any, manifest: flat.Manifest, i: int, ref: Any) -> None:
        self._pending.append(relay.offer.remote(manifest, i, [ref]))
        done, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        for result in done:   # collect errors of offers to dead relays so Ray does not warn
            try:
                ray.get(result)
            except Exception:  # noqa: BLE001 - the heartbeat reports dead relays
                pass

    def _complete(self, manifest: flat.Manifest, buffer: np.ndarray, **timings: float) -> None:
        clock = time.perf_counter()
        ref = ray.put(buffer)   # this node's object store: rollouts here read it without copying
        timings["serve_s"] = time.perf_counter() - clock
        with self._cond:
            self._current = (manifest, ref)
            if self._arriving is not None and self._arriving.manifest.version <= manifest.version:
                self._arriving = None
            self._cond.notify_all()
        self._log("relay_received", version=manifest.version, bytes=manifest.total_bytes,
                  **timings)

    def _reject(self, manifest: flat.Manifest, i: int, reason: str) -> None:
        self._log("chunk_rejected", version=manifest.version, chunk=i, reason=reason)
        with self._cond:
            self._rejected = max(self._rejected, manifest.version)
            if self._arriving is not None and self._arriving.manifest.version <= manifest.version:
                self._arriving = None
                self._log("version_aborted", version=manifest.version)

    def _snapshot(self) -> Snapshot | None:
        if self._current is None:
            return None
        manifest, ref = self._current
        return Snapshot(manifest.version, ref, manifest.index)

    def _log(self, kind: str, **fields: Any) -> None:
        rec = record(kind, relay=self.name, **fields)
        with self._cond:
            self._events.append(rec)


def _tick(timings: dict, key: str, since: float) -> float:
    now = time.perf_counter()
    timings[key] += now - since
    return now


def pull(relay: Any, *, newer_than: int | None = None, timeout_s: float | None = None
         ) -> tuple[int, np.ndarray, tuple[flat.TensorEntry, ...]] | None:
    """(version, buffer, index) from a relay: the latest, or the first newer than `newer_than`.

    On the relay's node the buffer is a read-only view of the object store (no copy).
    Returns None when the relay has nothing (yet), or nothing newer within `timeout_s`.
    """
    if newer_than is None:
        snap = ray.get(relay.latest.remote())
    else:
        snap = ray.get(relay.wait_newer.remote(newer_than, timeout_s))
    if snap is None:
        return None
    return snap.version, ray.get(snap.buffer), snap.index
