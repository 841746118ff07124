"""Relay-to-relay byte streams over TCP: the data path of the chain broadcast (Laminar §4.2).

Each relay listens on one TCP port (`StreamServer`, bound to the node IP Ray reports) and keeps one
connection per downstream relay (`StreamLink`, a sender thread fed by a queue). Bytes go straight
from the sender's memory into the receiver's preallocated version buffer (`recv_into`), so a hop
costs the kernel's socket copies and nothing else; the Ray object store carries only control
messages (who is downstream, which chunks a relay lacks) and is the fallback when a link breaks.

Wire format, little-endian, one frame after another on a connection:

    header   magic b"LJW1", kind (1 manifest, 2 chunk, 3 hello, 4 source, 5 chunk-at), version,
             chunk, offset, length, crc32
    payload  `length` bytes: the manifest as JSON (kind 1, before the first chunk of a version on
             this connection), the chunk's bytes (kind 2), the relay group's token (kind 3, the
             first frame of every connection), or the handle of the sender's version buffer as
             JSON (kind 4); kind 5 has no payload

Between relays on one host (`same_host` links) the bytes do not cross the socket: the sender
names its version buffer once per version (kind 4, a `shared_buffer.BufferHandle`), the receiver
maps it read-only, and each chunk-at frame (kind 5) says that [offset, offset + length) of that
buffer now holds the chunk. The sink decides where the chunk goes (`claim(..., source=)`): a
read-only view of that same buffer (the receiving relay shares the version's memory: nothing is
copied) or a writable view of its own buffer (the bytes are copied from the mapping).

A relay drops a connection whose first frame is not the hello with its group's token, so bytes
from anyone else (a relay of another run that now owns a dead relay's port, a stray client) never
reach a version buffer.

The receiver checks nothing itself; it asks its sink where the payload goes and hands it over:

    sink.claim(manifest, header, source=None) -> (view, ticket) | None
                                                            None: read and drop the payload;
                                                            source: a chunk-at frame's `Source`
    sink.received(ticket, view)                             the payload is in `view`
    sink.lost(ticket, error)                                the connection failed mid-payload
    sink.log(kind, **fields)                                "stream_error" events

Every read in the middle of a frame and every send has a timeout, so a stalled or dead peer
surfaces as a logged "stream_error", never as a hang. Threads stay bounded: a connection must send
its hello within `timeout_s`, a greeted connection idle for `idle_timeout_s` is closed (a link
idle for half that reconnects before it sends, so it never writes into a socket the server is
closing), and at most `max_connections` are served at once (more are closed on accept, counted in
one "stream_refused" event per second at most). Sockets release the GIL, so a relay receives
chunk k+1 while its sender thread forwards chunk k and its loop checks the crc32 of chunk k.
"""
from __future__ import annotations

import dataclasses
import hmac
import json
import queue
import socket
import struct
import threading
import time
from typing import Any, Callable

import numpy as np

from laminar_jax.weights import flat, shared_buffer

__all__ = ["Header", "Source", "StreamServer", "StreamLink", "connect", "write_manifest", "write_chunk",
           "write_source", "write_chunk_at", "manifest_to_json", "manifest_from_json"]

MAGIC = b"LJW1"
_HEADER = struct.Struct("<4sB3xqqqqI")
MANIFEST, CHUNK, HELLO, SOURCE, CHUNK_AT = 1, 2, 3, 4, 5
MAX_MANIFEST_BYTES = 64 * 2**20
MAX_TOKEN_BYTES = 256
MAX_SOURCE_BYTES = 4096
_DISCARD = 4 * 2**20
IDLE_TIMEOUT_S = 300.0
MAX_CONNECTIONS = 64


@dataclasses.dataclass(frozen=True)
class Header:
    kind: int
    version: int
    chunk: int
    offset: int
    length: int
    crc32: int


def manifest_to_json(m: flat.Manifest) -> bytes:
    """JSON, not pickle: a relay never unpickles bytes that came from a socket."""
    return json.dumps({"version": m.version, "total_bytes": m.total_bytes,
                       "chunks": m.chunks, "checksums": m.checksums,
                       "index": [[e.name, e.dtype, e.shape, e.offset] for e in m.index]}).encode()


def manifest_from_json(data: bytes) -> flat.Manifest:
    d = json.loads(data)
    return flat.Manifest(
        version=int(d["version"]), total_bytes=int(d["total_bytes"]),
        index=tuple(flat.TensorEntry(n, t, tuple(s), int(o)) for n, t, s, o in d["index"]),
        chunks=tuple((int(s), int(e)) for s, e in d["chunks"]),
        checksums=tuple(int(c) for c in d["checksums"]))


def connect(address: tuple[str, int], timeout_s: float, token: str = "") -> socket.socket:
    """A connection to a relay's stream server, opened with the hello frame carrying `token`."""
    payload = token.encode()
    if len(payload) > MAX_TOKEN_BYTES:
        raise ValueError(f"stream token of {len(payload)} bytes exceeds {MAX_TOKEN_BYTES}")
    sock = socket.create_connection(tuple(address), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.sendall(_HEADER.pack(MAGIC, HELLO, 0, -1, 0, len(payload), 0) + payload)
    return sock


def write_manifest(sock: socket.socket, manifest: flat.Manifest) -> None:
    payload = manifest_to_json(manifest)
    sock.sendall(_HEADER.pack(MAGIC, MANIFEST, manifest.version, -1, 0, len(payload), 0) + payload)


def write_chunk(sock: socket.socket, manifest: flat.Manifest, chunk: int, data: Any, *,
                offset: int | None = None, crc32: int | None = None) -> None:
    """One chunk frame; the header carries the master's offset and crc32 unless overridden."""
    view = memoryview(data).cast("B")
    start = manifest.chunks[chunk][0] if offset is None else offset
    crc = manifest.checksums[chunk] if crc32 is None else crc32
    sock.sendall(_HEADER.pack(MAGIC, CHUNK, manifest.version, chunk, start, len(view), crc))
    sock.sendall(view)


def write_source(sock: socket.socket, version: int, handle: shared_buffer.BufferHandle) -> None:
    payload = json.dumps(handle.to_json()).encode()
    sock.sendall(_HEADER.pack(MAGIC, SOURCE, version, -1, 0, len(payload), 0) + payload)


def write_chunk_at(sock: socket.socket, manifest: flat.Manifest, chunk: int) -> None:
    """Chunk `chunk` is in the buffer of the last source frame of its version: copy it from there."""
    start, end = manifest.chunks[chunk]
    sock.sendall(_HEADER.pack(MAGIC, CHUNK_AT, manifest.version, chunk, start, end - start,
                              manifest.checksums[chunk]))


def _read_into(sock: socket.socket, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


@dataclasses.dataclass(frozen=True)
class Source:
    """A same-host sender's version buffer: its handle and this process's read-only mapping."""

    handle: shared_buffer.BufferHandle
    array: np.ndarray


def _map_source(payload: bytes) -> Source | str:
    """The sender's version buffer mapped read-only, or why it cannot be (it was released)."""
    try:
        handle = shared_buffer.BufferHandle.from_json(json.loads(payload))
        return Source(handle, shared_buffer.open_handle(handle))
    except (LookupError, ValueError, TypeError, OSError) as e:
        return f"source buffer not mapped: {e!r}"


class StreamServer:
    """Listens on (host, port 0) and reads frames from every connection that opens with the
    hello frame carrying `token` into `sink`."""

    def __init__(self, sink: Any, host: str, *, timeout_s: float = 60.0, token: str = "",
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS):
        self._sink, self._timeout_s, self._token = sink, timeout_s, token.encode()
        self._idle_timeout_s, self._max_connections = idle_timeout_s, max_connections
        self._refused, self._refused_logged = 0, 0.0
        self._sock = socket.create_server((host, 0), backlog=128)
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="stream-accept", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for s in [self._sock, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return   # closed
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            with self._lock:
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self._refuse(conn, peer)
                continue
            threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"),
                             name="stream-recv", daemon=True).start()

    def _refuse(self, conn: socket.socket, peer: tuple) -> None:
        conn.close()
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged >= 1.0:   # a flood costs one event per second, not one each
            self._refused_logged = now
            self._sink.log("stream_refused", peer=f"{peer[0]}:{peer[1]}", refused=self._refused,
                           max_connections=self._max_connections)

    @property
    def refused(self) -> int:
        """Connections closed on accept because max_connections were being served."""
        return self._refused

    def connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._conns)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            self._frames(conn, peer)
        except Exception as e:  # noqa: BLE001 - socket errors, bad frames: log, drop the connection
            if not self._closed:
                self._sink.log("stream_error", peer=peer, where="receive", error=repr(e))
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _frames(self, conn: socket.socket, peer: str) -> None:
        manifests: dict[int, flat.Manifest] = {}
        source: tuple[int, Source | str] | None = None   # (version, mapping or why not)
        raw = bytearray(_HEADER.size)
        greeted = False
        while True:
            # before the hello: the stream timeout (a stray or half-open connection costs a thread
            # that long); after it, an idle link is normal up to idle_timeout_s
            conn.settimeout(self._idle_timeout_s if greeted else self._timeout_s)
            try:
                n = conn.recv_into(raw, 1)
            except socket.timeout:
                if greeted:
                    return        # idle: the link reconnects when it next sends
                raise ValueError(f"no hello within {self._timeout_s:.0f} s") from None
            if n == 0:
                return            # closed between frames
            conn.settimeout(self._timeout_s)
            if _read_into(conn, memoryview(raw)[1:]) != _HEADER.size - 1:
                raise ValueError("connection closed inside a frame header")
            magic, kind, version, chunk, offset, length, crc = _HEADER.unpack(raw)
            if magic != MAGIC or not MANIFEST <= kind <= CHUNK_AT or length < 0:
                raise ValueError(f"bad frame header {bytes(raw)!r}")
            if (kind == HELLO) == greeted:
                raise ValueError("a connection must open with one hello frame")
            if kind == HELLO:
                payload = bytearray(min(length, MAX_TOKEN_BYTES + 1))
                if length > MAX_TOKEN_BYTES or _read_into(conn, memoryview(payload)) != length \
                        or not hmac.compare_digest(bytes(payload), self._token):
                    raise ValueError("stream token does not match this relay group's")
                greeted = True
                continue
            if kind in (MANIFEST, SOURCE):
                limit = MAX_MANIFEST_BYTES if kind == MANIFEST else MAX_SOURCE_BYTES
                if length > limit:
                    raise ValueError(f"frame kind {kind} of {length} bytes exceeds {limit}")
                payload = bytearray(length)
                if _read_into(conn, memoryview(payload)) != length:
                    raise ValueError(f"connection closed inside frame kind {kind} of version "
                                     f"{version}")
                if kind == MANIFEST:
                    manifests = {v: m for v, m in manifests.items() if v > version - 2}
                    manifests[version] = manifest_from_json(bytes(payload))
                else:
                    # the old mapping may be the last of a whole version: freeing it takes time
                    shared_buffer.drop_later(source)
                    source = (version, _map_source(bytes(payload)))
                continue
            header = Header(kind, version, chunk, offset, length, crc)
            manifest = manifests.get(version)
            claimed = problem = None
            if manifest is None:
                problem = "chunk before its version's manifest"
            elif length > manifest.total_bytes:
                raise ValueError(f"chunk {chunk} of {length} bytes exceeds version {version}'s "
                                 f"{manifest.total_bytes}")
            elif kind == CHUNK_AT and (source is None or source[0] != version
                                       or isinstance(source[1], str)):
                problem = ("no mapped source buffer for this version" if source is None
                           or source[0] != version else source[1])
            elif kind == CHUNK_AT and offset + length > source[1].array.size:
                raise ValueError(f"chunk {chunk} [{offset}, {offset + length}) lies outside the "
                                 f"source buffer of {source[1].array.size} bytes")
            elif kind == CHUNK_AT:
                claimed = self._sink.claim(manifest, header, source=source[1])
            else:
                claimed = self._sink.claim(manifest, header)
            if problem is not None:
                self._sink.log("stream_error", peer=peer, where="receive", version=version,
                               chunk=chunk, error=problem)
            if claimed is None:
                if kind == CHUNK:
                    self._discard(conn, length)
                continue
            view, ticket = claimed
            if kind == CHUNK_AT:
                if view.flags.writeable:   # else the sink shares the source: nothing to copy
                    np.copyto(view, source[1].array[offset:offset + length])
                self._sink.received(ticket, view)
                continue
            try:
                got = _read_into(conn, memoryview(view).cast("B"))
            except OSError as e:
                self._sink.lost(ticket, repr(e))
                raise
            if got != length:
                self._sink.lost(ticket, f"connection closed after {got} of {length} bytes")
                raise ValueError(f"connection closed inside chunk {chunk} of version {version}")
            self._sink.received(ticket, view)

    @staticmethod
    def _discard(conn: socket.socket, length: int) -> None:
        scratch = memoryview(bytearray(min(length, _DISCARD)))
        while length > 0:
            n = conn.recv_into(scratch[:min(length, len(scratch))])
            if n == 0:
                raise ValueError("connection closed inside a dropped chunk")
            length -= n


class StreamLink:
    """One connection to a downstream relay and the thread that sends on it, in order.

    `send` queues (manifest, chunk, view) and returns at once; `done()` (if given) runs once the
    bytes left or the item was dropped, so the caller knows when `view` is no longer read. The
    version's manifest precedes its first chunk. With `same_host` and a `source` (the handle of
    the shared buffer `view` lies in), only a chunk-at frame goes: the receiver copies the bytes
    from its mapping of that buffer. A failed send is retried once on a new
    connection; after that the link logs "stream_error" and hands this and every later item to
    `fallback(manifest, chunk, view)` (the object store).
    """

    def __init__(self, relay: Any, address: tuple[str, int], *, timeout_s: float,
                 log: Callable[..., None], fallback: Callable[..., None], token: str = "",
                 same_host: bool = False, idle_timeout_s: float = IDLE_TIMEOUT_S):
        self.relay, self.address, self.same_host = relay, tuple(address), same_host
        self._timeout_s, self._log, self._fallback = timeout_s, log, fallback
        self._token = token
        self._idle_timeout_s = idle_timeout_s
        self._sock: socket.socket | None = connect(self.address, timeout_s, token)
        self._last_send = time.monotonic()
        self._manifest_sent: int | None = None
        self._source_sent: tuple[int, int] | None = None    # (version, inode)
        self._queue: queue.Queue = queue.Queue()
        self._broken = self._closed = False
        self._thread = threading.Thread(target=self._run, name="stream-send", daemon=True)
        self._thread.start()

    def send(self, manifest: flat.Manifest, chunk: int, view: Any,
             done: Callable[[], None] | None = None,
             source: shared_buffer.BufferHandle | None = None) -> None:
        if self._closed:
            if done is not None:
                done()
            return
        self._queue.put((manifest, chunk, view, done, source if self.same_host else None))

    def close(self) -> None:
        """Stops sending; queued items are dropped (their `done` still runs)."""
        self._closed = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            manifest, chunk, view, done, source = item
            try:
                if not self._closed:
                    self._deliver(manifest, chunk, view, source)
            except Exception as e:  # noqa: BLE001 - the sender thread must keep draining
                self._log("stream_error", to=f"{self.address[0]}:{self.address[1]}",
                          where="send", version=manifest.version, chunk=chunk, error=repr(e))
            finally:
                del view
                if done is not None:
                    done()
        while True:   # closed: release what is left
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[3] is not None:
                item[3]()
        if self._sock is not None:
            self._sock.close()

    def _deliver(self, manifest: flat.Manifest, chunk: int, view: Any,
                 source: shared_buffer.BufferHandle | None) -> None:
        if self._broken:
            self._fallback(manifest, chunk, view)
            return
        if self._sock is not None and time.monotonic() - self._last_send > self._idle_timeout_s / 2:
            self._sock.close()    # the server may be closing it as idle: start a fresh one
            self._sock = None
        for attempt in (0, 1):
            try:
                self._last_send = time.monotonic()
                if self._sock is None:
                    self._sock = connect(self.address, self._timeout_s, self._token)
                    self._manifest_sent = self._source_sent = None
                if self._manifest_sent != manifest.version:
                    write_manifest(self._sock, manifest)
                    self._manifest_sent = manifest.version
                if source is None:
                    write_chunk(self._sock, manifest, chunk, view)
                    return
                if self._source_sent != (manifest.version, source.inode):
                    write_source(self._sock, manifest.version, source)
                    self._source_sent = (manifest.version, source.inode)
                write_chunk_at(self._sock, manifest, chunk)
                return
            except OSError as e:
                if self._closed:
                    return
                self._log("stream_error", to=f"{self.address[0]}:{self.address[1]}",
                          where="send", version=manifest.version, chunk=chunk, error=repr(e),
                          retry=attempt == 0)
                if self._sock is not None:
                    self._sock.close()
                self._sock = None
        self._broken = True
        self._log("stream_fallback", to=f"{self.address[0]}:{self.address[1]}",
                  version=manifest.version, chunk=chunk)
        self._fallback(manifest, chunk, view)
