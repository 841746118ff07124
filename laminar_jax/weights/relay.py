"""RelayWorker: one per node, holds the latest weights in host memory (Laminar §4, Fig 6, Fig 7).

A relay is a Ray actor (threaded, CPU only). Chunk bytes move between relays over one of two
transports (`transport=`):

    "tcp"           (default) a direct stream per link (`weights.stream`): the upstream's sender
                    thread writes chunk k from its memory, this relay reads it straight into its
                    preallocated version buffer, forwards it downstream from that same memory
                    (cut-through) while it reads chunk k+1, and the loop checks its crc32.
    "object_store"  each chunk is a Ray object: `ray.put` upstream, `offer` here, `ray.get`.

Control always goes through Ray. One loop thread handles the inbox in order:

    publish(version, path)   master only: `master.prepare` (restore the orbax checkpoint to host
                             numpy, engine layout, k checksummed chunks), send every chunk
                             downstream, serve the version, prune the weight store.
    chunk / stream_chunk     a chunk arrived (object store / stream): check its length, offset and
                             crc32, and serve the version when all k chunks are in. A bad chunk is
                             rejected and the arriving version dropped; the previous version stays
                             served. Chunks are forwarded before the check; every relay checks
                             against the master's checksums itself.
    relink                   after `set_downstream` linked each new downstream (a stream when
                             both ends use tcp, else the object store): ask it which chunks it
                             lacks and send them from the current and the arriving version.

A stream link that fails twice falls back to the object store ("stream_fallback" event), so a
broken socket costs speed, not the version; a dead relay is cut out by the group's heartbeat.

Rollouts call `latest()` (answers at once) or `wait_newer(version, timeout_s)`; both return a
`Snapshot(version, buffer, index, handle)`. With `shared_memory` (default, Linux) version buffers
are memfds (`weights.shared_buffer`) and `handle` names the served one: a rollout on this host maps
it read-only, so serving a version copies nothing, and relays on this host share one buffer per
version (each checks every chunk in it) instead of streaming the bytes. Otherwise `buffer` is an
ObjectRef to the flat buffer in this node's object store (`ray.get` on the same node maps it
without copying). `read` below
does either, and falls back to an object-store copy for a reader on another host. A relay holds
the current version and at most one arriving version (plus the buffer prepared for the next one:
shared buffers are never reused while rollouts may read them).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import queue
import threading
import time
from typing import Any

import numpy as np
import ray

from laminar_jax.weights import flat, host_shards, master, shared_buffer, stream
from laminar_jax.weights.events import record
from laminar_jax.weights.relay_links import Downstream
from laminar_jax.weights.relay_state import Arrival, Served, Versions
from laminar_jax.weights.standby import Standby

__all__ = ["RelayWorker", "Snapshot", "pull", "read", "TRANSPORTS"]

TRANSPORTS = ("tcp", "object_store")
STANDBY_WAIT_S = 600.0   # how long a standby master waits for the store's first version to warm on
MAX_WAIT_S = 300.0       # the longest a `wait_newer` call waits inside the relay


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A complete version as served: `handle` names the relay's shared buffer, else `buffer` is an
    ObjectRef to the uint8 flat buffer (`read` takes either)."""

    version: int
    buffer: Any
    index: tuple[flat.TensorEntry, ...]
    handle: shared_buffer.BufferHandle | None = None


@dataclasses.dataclass(frozen=True)
class _Claim:
    arrival: Arrival
    chunk: int
    header: stream.Header
    direct: bool                # read into the version buffer (else into scratch, to be rejected)


class _Sink:
    """The stream server's view of a relay (kept off the actor's remote methods)."""

    def __init__(self, relay: "RelayWorker"):
        self.claim, self.received = relay._stream_claim, relay._stream_received
        self.lost, self.log = relay._stream_lost, relay._log


class RelayWorker:
    """Relay actor body; create with `ray.remote(RelayWorker).options(max_concurrency=...)`.

    Args:
      name: this relay's id in the chain (the node id).
      transport: "tcp" (direct streams, default) or "object_store" (see the module docstring).
      fetch_timeout_s: how long one object-store chunk fetch may take before it counts as lost.
      prefetch: object-store chunks fetched ahead of the loop.
      stream_timeout_s: limit on connecting, on one chunk's send, and on a read inside a frame.
      host: address to listen on (default: the node IP Ray reports; `RelayGroup` passes
        127.0.0.1 when every relay is on one host).
      idle_timeout_s, max_connections: the stream server's bounds (`weights.stream`).
      stream_token: shared by the relays of one group; streams without it are dropped.
      shared_memory: version buffers in shared memory (rollouts and same-host relays map them);
        False, or no memfd on this system: numpy buffers, served through the object store.
      shared_links: with shared_memory, same-host downstream relays share this relay's buffer;
        False streams the bytes to them as to another host (to measure that path).
    """

    def __init__(self, name: str, *, transport: str = "tcp", fetch_timeout_s: float = 120.0,
                 prefetch: int = 2, stream_timeout_s: float = 60.0, host: str | None = None,
                 stream_token: str = "", shared_memory: bool = True, shared_links: bool = True,
                 idle_timeout_s: float = stream.IDLE_TIMEOUT_S,
                 max_connections: int = stream.MAX_CONNECTIONS):
        if transport not in TRANSPORTS:
            raise ValueError(f"RelayWorker: transport must be one of {TRANSPORTS}, got {transport!r}")
        self.name, self.transport = name, transport
        self._fetch_timeout_s = fetch_timeout_s
        self._fetcher = concurrent.futures.ThreadPoolExecutor(prefetch, thread_name_prefix="fetch")
        self._pruner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prune")
        self._inbox: queue.Queue = queue.Queue()
        self._events: list[dict] = []
        self._events_lock = threading.Lock()
        shared = shared_memory and shared_buffer.available()
        self._pool = shared_buffer.BufferPool(f"laminar-relay-{name}") if shared else None
        self._host_key = shared_buffer.host_key() if shared else None
        self._versions = Versions(self._log, keep_spare=transport == "tcp" and not shared,
                                  allocate=None if self._pool is None else self._pool.take)
        self._announced = -1         # master: newest version announced by the publisher
        self._down = Downstream(tcp=transport == "tcp", timeout_s=stream_timeout_s, log=self._log,
                                token=stream_token, idle_timeout_s=idle_timeout_s,
                                host_key=self._host_key if shared_links else None)
        self._role: master.MasterRole | None = None
        self._warm = False           # ran one master step (master since a publish)
        self._standby: Standby | None = None   # following the store as the next master in line
        self._reads = 0              # orbax restores of the store (master steps, past standbys)
        self._stopping = threading.Event()
        self._server = None
        if transport == "tcp":
            host = host or ray.util.get_node_ip_address()
            self._server = stream.StreamServer(_Sink(self), host, timeout_s=stream_timeout_s,
                                               token=stream_token, idle_timeout_s=idle_timeout_s,
                                               max_connections=max_connections)
        self._loop_thread = threading.Thread(target=self._loop, name="relay-loop", daemon=True)
        self._loop_thread.start()

    # ------------------------------------------------------------------ remote API
    def ping(self) -> str:
        return self.name

    def prepare_standby(self, role: master.MasterRole | None = None,
                        wait_s: float = STANDBY_WAIT_S, *, after_failover: bool = False) -> None:
        """The group's next master in line gets ready ahead of time: given `role`, it follows
        the weight store at the lowest CPU priority (`weights.standby`): each committed version
        it does not serve yet is restored, converted and checksummed into a buffer of its own,
        so a promotion serves the newest version without reading the store, and the process's
        first orbax restore (seconds of CPU more than later ones) is paid ahead. It follows at
        once, unless `after_failover`: then its first read waits (up to `wait_s`) until this
        relay serves a version newer than the one it served when asked, so that it takes no
        cores from the new master's first broadcast. Without `role`: only the imports a master
        needs."""
        if self._role is not None or self._stopping.is_set():
            return
        old = self._standby
        if old is not None:
            old.stop()
            self._reads += old.reads
        if role is None:
            def imports() -> None:
                import orbax.checkpoint  # noqa: F401
                from laminar_jax.weights import publish  # noqa: F401
            threading.Thread(target=imports, name="standby-imports", daemon=True).start()
            return
        served = self._versions.current_version
        first_after = (-1 if served is None else served) if after_failover else None
        self._standby = Standby(role, served=lambda: self._versions.current_version,
                                allocate=None if self._pool is None else self._pool.take,
                                log=self._log, first_after=first_after, wait_s=wait_s).start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Clean shutdown: no more messages are handled, the one in hand (a master step, which
        reads the store) and the standby's read in flight end first, and the stream server and
        links close. The group calls it before the store is removed and the actor killed."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        if self._standby is not None:
            self._standby.stop(timeout_s)
        self._inbox.put(("stop", ()))
        self._loop_thread.join(max(0.0, deadline - time.monotonic()))
        self._down.relink(())
        if self._server is not None:
            self._server.close()

    def watch(self, seconds: float) -> str:
        """Returns after `seconds`: the group's monitor keeps one such call open per relay, so
        the relay's death fails it at once (`RelayGroup.start_monitor`)."""
        time.sleep(min(float(seconds), 300.0))
        return self.name

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def stream_address(self) -> tuple[str, int] | None:
        """(host, port) this relay receives streams on; None with the object-store transport."""
        return None if self._server is None else self._server.address

    def host_key(self) -> str | None:
        """`shared_buffer.host_key()` when this relay's buffers are shared, else None."""
        return self._host_key

    def configure_master(self, role: master.MasterRole) -> None:
        """Makes this relay the master (or updates its role). A relay just promoted serves the
        store's newest version at once, without waiting for the publisher's re-announcement
        (one more hop through the learner, slow on a loaded machine; that one is then skipped):
        from its standby's prepared copy when it has that version, else by restoring it."""
        promoted, self._role = self._role is None, role
        if promoted and self._standby is not None:
            self._standby.stop()   # its prepared version waits for this master's first publish
        if promoted and not self._stopping.is_set():
            versions = role.store.versions() if os.path.isdir(role.store.root) else []
            if versions:
                self.publish(versions[-1], role.store.path(versions[-1]))

    def set_downstream(self, downstream: list) -> None:
        """New downstream relay handles (one in a chain, all others for a fan-out master). The
        links are open when this returns; the resend of what they lack follows on the loop."""
        self._down.relink(tuple(downstream))
        self._inbox.put(("relink", ()))

    def publish(self, version: int, path: str) -> None:
        """From the publisher: `version` is complete in the weight store at `path`."""
        with self._versions.cond:
            self._announced = max(self._announced, version)
        self._inbox.put(("publish", (version, path)))

    def offer(self, manifest: flat.Manifest, chunk: int, refs: list) -> None:
        """From upstream: chunk `chunk` of `manifest.version` is `refs[0]` (a list, so Ray
        passes the ref instead of the bytes). The fetch starts now."""
        fetch = self._fetcher.submit(ray.get, refs[0], timeout=self._fetch_timeout_s)
        self._inbox.put(("chunk", (manifest, chunk, fetch)))

    def latest(self) -> Snapshot | None:
        return _snapshot(self._versions.current)

    def wait_newer(self, version: int, timeout_s: float | None = None) -> Snapshot | None:
        """The first complete version newer than `version`, or None after `timeout_s` (None or
        more: MAX_WAIT_S, so a caller that gave up never holds one of the actor's threads)."""
        limit = MAX_WAIT_S if timeout_s is None else min(float(timeout_s), MAX_WAIT_S)
        return _snapshot(self._versions.wait_newer(version, limit))

    def buffer_ref(self, version: int) -> list | None:
        """[ObjectRef] of the served buffer if it is still `version` (for a reader that cannot
        map the shared buffer: one object-store copy, made once per version), else None."""
        with self._versions.cond:
            current = self._versions.current
            if current is None or current[0].version != version:
                return None
            served = current[1]
            if served.ref is None:
                served.ref = ray.put(served.buffer)
            return [served.ref]

    def chunks_held(self, version: int) -> frozenset[int] | None:
        """Chunks of `version` already accepted here, or None when this relay needs none of
        them (it serves this version or a newer one, or dropped it after a bad chunk)."""
        return self._versions.chunks_held(version)

    def status(self) -> dict:
        standby = self._standby
        return {"name": self.name, "master": self._role is not None,
                "warm": self._warm or (standby is not None and standby.warm), "transport": self.transport,
                **self._versions.status(), "downstream": len(self._down),
                # orbax restores of the store: master steps, and the standby's follower
                "store_reads": self._reads + (0 if standby is None else standby.reads),
                "standby_prepared": None if standby is None or standby.prepared is None
                else standby.prepared.manifest.version,
                "standby_caught_up": standby is not None and standby.caught_up()}

    def drain_events(self) -> list[dict]:
        with self._events_lock:
            out, self._events = self._events, []
        return out

    def hold(self, after_chunks: int) -> None:
        """Fault drill: stop forwarding after `after_chunks` more chunks until `release()`."""
        self._down.hold(after_chunks)

    def release(self) -> None:
        self._down.release()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        handlers = {"publish": self._on_publish, "chunk": self._on_chunk,
                    "stream_chunk": self._on_stream_chunk, "relink": self._on_relink}
        while True:
            kind, args = self._inbox.get()
            if kind == "stop":
                return
            try:
                handlers[kind](*args)
            except Exception as e:  # noqa: BLE001 - a relay must survive one bad message
                self._log("relay_error", message=kind, error=repr(e))

    def _on_publish(self, version: int, path: str) -> None:
        role = self._role
        if role is None:
            self._log("relay_error", message="publish", error="not the master", version=version)
            return
        current = self._versions.current_version
        if current is not None and version <= current:
            return
        if version < self._announced:   # a newer version is queued: relays need only the latest
            self._log("publish_skipped", version=version, newer=self._announced)
            return
        standby, self._standby = self._standby, None
        if standby is not None:
            self._reads += standby.reads
        prepared = None if standby is None else standby.take(version)   # promoted: it follows
        if prepared is not None:   # the standby's step, done ahead: no store read here
            manifest, buffer, source, timings = (prepared.manifest, prepared.buffer, prepared.shared,
                                                 prepared.timings)
            if manifest.num_chunks != role.chunks_for(buffer.size):   # the chain changed since
                manifest = flat.make_manifest(version, buffer, manifest.index, role.chunks_for(buffer.size))
        else:
            try:
                manifest, buffer, source, timings = self._restore(role, version, path)
            except host_shards.ShardError as e:   # a learner host's shards missing or torn: not served
                self._log("publish_incomplete", version=version, host=getattr(e, "host", None),
                          tensor=getattr(e, "tensor", None), error=str(e))
                return
        self._warm = True
        self._log("master_restored", version=version, bytes=int(buffer.size),
                  chunks=manifest.num_chunks, standby=prepared is not None, **timings)
        clock = time.perf_counter()
        for i, (s, e) in enumerate(manifest.chunks):
            self._down.forward(manifest, i, buffer[s:e],
                               source=None if source is None else source.handle)
        self._complete(manifest, buffer, shared=source, forward_s=time.perf_counter() - clock)
        self._pruner.submit(self._prune, role, version)

    def _restore(self, role: master.MasterRole, version: int, path: str):
        """The master step on the store: (manifest, buffer, its SharedBuffer or None, timings)."""
        shared: list[shared_buffer.SharedBuffer] = []

        def allocate(nbytes: int) -> np.ndarray:   # the master converts straight into it
            # not faulted in ahead: the conversion writes every page anyway, and a prepare would
            # compete with the broadcast for the cores
            shared.append(self._pool.take(nbytes, populate=False))
            return shared[-1].array

        self._reads += 1
        manifest, buffer, timings = master.prepare(
            role, version, path, allocate=None if self._pool is None else allocate)
        return manifest, buffer, shared[0] if shared else None, timings

    def _prune(self, role: master.MasterRole, version: int) -> None:
        """Off the loop, at low priority: deleting a version frees as many pages as the model
        has bytes, CPU the broadcast of the version just served needs."""
        shared_buffer.background_priority()
        try:
            pruned = master.prune(role, version)
        except Exception as e:  # noqa: BLE001 - a store that cannot be pruned is no reason to stop
            self._log("relay_error", message="prune", error=repr(e))
            return
        if pruned:
            self._log("store_pruned", versions=pruned)

    def _on_chunk(self, manifest: flat.Manifest, i: int, fetch: concurrent.futures.Future) -> None:
        """A chunk offered through the object store."""
        versions = self._versions
        claimed = None if versions.stale(manifest.version) else versions.claim(manifest, i)
        if claimed is None or claimed[1] == "busy":   # not needed, or arriving over a stream now
            fetch.cancel()
            return
        arrival, state = claimed
        clock, timings = time.perf_counter(), arrival.timings
        try:
            # the fetch itself is bounded (fetch_timeout_s); this bounds its wait for a thread
            data = fetch.result(timeout=2 * self._fetch_timeout_s)
        except Exception as e:  # noqa: BLE001 - upstream died or the object is gone
            # The relink after the failure resends what is missing.
            self._log("chunk_lost", version=manifest.version, chunk=i, error=type(e).__name__)
            if state == "direct":
                versions.done_receiving(arrival, i)
            return
        clock = _tick(timings, "wait_s", clock)
        # Cut-through: pass the chunk on before checking it, so a hop adds a fetch and a put to
        # the pipeline, not the checksum and the copy too.
        self._down.forward(manifest, i, data)
        clock = _tick(timings, "forward_s", clock)
        problem = flat.check_chunk(manifest, i, data)
        if problem is None:
            clock = _tick(timings, "check_s", clock)
            s, e = manifest.chunks[i]
            arrival.buffer[s:e] = data
            _tick(timings, "copy_s", clock)
        del data
        if state == "direct" and not versions.done_receiving(arrival, i):
            return
        if problem is not None:
            versions.reject(manifest, i, problem)
        elif versions.accept(arrival, i, "object_store"):
            self._complete(manifest, arrival.buffer, arrival, arrival.shared, **timings)

    def _on_stream_chunk(self, claim: _Claim, view: np.ndarray) -> None:
        """A chunk read from a stream (into the version buffer, or into scratch when its header
        does not fit the manifest): check its length, offset and crc32, accept it."""
        arrival, i, header = claim.arrival, claim.chunk, claim.header
        versions = self._versions
        if claim.direct:
            if not versions.done_receiving(arrival, i):
                return
        elif versions.arriving is not arrival:
            return
        clock = time.perf_counter()
        manifest = arrival.manifest
        problem = flat.check_chunk(manifest, i, view)
        if problem is None and header.offset != manifest.chunks[i][0]:
            problem = (f"chunk {i}: header offset {header.offset} differs from the chunk start "
                       f"{manifest.chunks[i][0]}")
        if problem is None and header.crc32 != manifest.checksums[i]:
            problem = f"chunk {i}: header crc32 {header.crc32:#010x} differs from the manifest's"
        if problem is not None:
            versions.reject(manifest, i, problem)
            return
        _tick(arrival.timings, "check_s", clock)
        via = "shared_memory" if header.kind == stream.CHUNK_AT else "tcp"
        if versions.accept(arrival, i, via):
            self._complete(manifest, arrival.buffer, arrival, arrival.shared, **arrival.timings)

    def _on_relink(self) -> None:
        with self._versions.cond:
            current, arrival = self._versions.current, self._versions.arriving
            # streams forward chunks before the loop checks them: resend what landed as well
            have = None if arrival is None else frozenset(arrival.have | arrival.landed)
        sources = []
        if current is not None:
            sources.append((current[0], current[1].buffer, None, None, current[1].shared))
        if arrival is not None:
            sources.append((arrival.manifest, arrival.buffer, have, arrival, arrival.shared))
        for link in self._down.links:
            for manifest, buffer, have, owner, shared in sources:
                try:
                    held = ray.get(link.relay.chunks_held.remote(manifest.version), timeout=30)
                except Exception as e:  # noqa: BLE001 - the group's next heartbeat handles it
                    self._log("relay_error", message="relink", error=repr(e))
                    break
                if held is None:
                    continue
                needed = [i for i in range(manifest.num_chunks)
                          if i not in held and (have is None or i in have)]
                if needed:
                    self._log("relay_resend", version=manifest.version, chunks=len(needed),
                              transport="object_store" if link.address is None else "tcp")
                for i in needed:
                    s, e = manifest.chunks[i]
                    self._down.send(link, manifest, i, buffer[s:e], owner,
                                    None if shared is None else shared.handle)

    # ------------------------------------------------------------------ stream sink
    def _stream_claim(self, manifest: flat.Manifest, header: stream.Header,
                      source: stream.Source | None = None) -> tuple[np.ndarray, _Claim] | None:
        i = header.chunk
        fits = (0 <= i < manifest.num_chunks and header.offset == manifest.chunks[i][0]
                and header.length == manifest.chunks[i][1] - manifest.chunks[i][0])
        claimed = self._versions.claim(manifest, i, fits=fits, source=source)
        if claimed is None or claimed[1] == "busy":
            return None
        arrival, state = claimed
        if state == "direct":
            s, e = manifest.chunks[i]
            return arrival.buffer[s:e], _Claim(arrival, i, header, True)
        return np.empty(header.length, np.uint8), _Claim(arrival, i, header, False)

    def _stream_received(self, claim: _Claim, view: np.ndarray) -> None:
        if claim.direct:   # cut-through, from the version buffer itself
            # Marked before forwarding: if a relink closes the link this forward goes to, the
            # relink's resend (which runs after the new links are in place) includes this chunk.
            with self._versions.cond:
                claim.arrival.landed.add(claim.chunk)
            clock = time.perf_counter()
            shared = claim.arrival.shared
            self._down.forward(claim.arrival.manifest, claim.chunk, view, owner=claim.arrival,
                               source=None if shared is None else shared.handle)
            _tick(claim.arrival.timings, "forward_s", clock)
        self._inbox.put(("stream_chunk", (claim, view)))

    def _stream_lost(self, claim: _Claim, error: str) -> None:
        self._versions.done_receiving(claim.arrival, claim.chunk)
        self._log("chunk_lost", version=claim.arrival.manifest.version, chunk=claim.chunk,
                  error=error)

    # ------------------------------------------------------------------ helpers
    def _complete(self, manifest: flat.Manifest, buffer: np.ndarray,
                  arrival: Arrival | None = None,
                  shared: shared_buffer.SharedBuffer | None = None, **timings: float) -> None:
        clock = time.perf_counter()
        # Rollouts map a shared buffer as it is; a numpy one goes to this node's object store,
        # where rollouts here read it without copying.
        served = Served(buffer, shared, None if shared is not None else ray.put(buffer))
        timings["serve_s"] = time.perf_counter() - clock
        via = {} if arrival is None else {f"via_{k}": n for k, n in arrival.via.items()}
        # logged before serving: whoever sees the version served finds its record too
        self._log("relay_received", version=manifest.version, bytes=manifest.total_bytes,
                  **via, **timings)
        self._versions.serve(manifest, served, arrival)
        if self._pool is not None and self._role is None and shared is not None \
                and shared.writable:   # received into its own buffer: likely the next one too
            self._pool.prepare(manifest.total_bytes)   # the next version's buffer, ahead of it

    def _log(self, kind: str, **fields: Any) -> None:
        rec = record(kind, relay=self.name, **fields)
        with self._events_lock:
            self._events.append(rec)


def _snapshot(current: tuple[flat.Manifest, Served] | None) -> Snapshot | None:
    if current is None:
        return None
    manifest, served = current
    return Snapshot(manifest.version, served.ref, manifest.index,
                    None if served.shared is None else served.shared.handle)


def _tick(timings: dict, key: str, since: float) -> float:
    now = time.perf_counter()
    timings[key] += now - since
    return now


def read(relay: Any, snap: Snapshot, *, call_timeout_s: float = 120.0) -> np.ndarray:
    """The flat buffer of `snap`, read-only: the relay's shared buffer mapped (same host), else
    the object-store copy (zero-copy on the relay's node). Raises `shared_buffer.BufferGone`
    when the relay has served a newer version since `snap`: ask for the latest again."""
    if snap.handle is not None:
        try:
            return shared_buffer.open_handle(snap.handle)
        except shared_buffer.NotLocal:
            pass
    refs = [snap.buffer] if snap.buffer is not None else ray.get(
        relay.buffer_ref.remote(snap.version), timeout=call_timeout_s)
    if refs is None:
        raise shared_buffer.BufferGone(f"version {snap.version} is no longer served")
    return ray.get(refs[0], timeout=call_timeout_s)


def pull(relay: Any, *, newer_than: int | None = None, timeout_s: float | None = None,
         call_timeout_s: float = 120.0) -> tuple[int, np.ndarray, tuple[flat.TensorEntry, ...]] | None:
    """(version, buffer, index) from a relay: the latest, or the first newer than `newer_than`.

    On the relay's host the buffer is a read-only view of the relay's memory (no copy).
    Returns None when the relay has nothing (yet), or nothing newer within `timeout_s`. Every
    call to the relay has a limit (`call_timeout_s`, plus `timeout_s` for `wait_newer`): a relay
    that does not answer raises GetTimeoutError, a dead one RayActorError.
    """
    while True:
        if newer_than is None:
            snap = ray.get(relay.latest.remote(), timeout=call_timeout_s)
        else:
            snap = ray.get(relay.wait_newer.remote(newer_than, timeout_s),
                           timeout=call_timeout_s + (timeout_s or 0.0))
        if snap is None:
            return None
        try:
            return snap.version, read(relay, snap, call_timeout_s=call_timeout_s), snap.index
        except shared_buffer.BufferGone:
            continue   # superseded between the answer and the read: a newer one is served
