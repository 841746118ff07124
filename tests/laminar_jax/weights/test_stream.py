"""Relay-to-relay TCP streams (`weights.stream`) with real sockets on loopback, without Ray."""
import socket
import threading
import time

import numpy as np
import pytest

from laminar_jax.weights import flat, shared_buffer, stream

HOST = "127.0.0.1"
TOKEN = "group-token"


class Sink:
    """Receives every chunk into one buffer laid out like the manifest; records all calls."""

    def __init__(self, size: int):
        self.buffer = np.zeros(size, np.uint8)
        self.got, self.lost_calls, self.events = [], [], []
        self.cond = threading.Condition()

    def claim(self, manifest, header, source=None):
        s, e = manifest.chunks[header.chunk]
        return self.buffer[s:e], (manifest, header)

    def received(self, ticket, view):
        with self.cond:
            self.got.append(ticket)
            self.cond.notify_all()

    def lost(self, ticket, error):
        with self.cond:
            self.lost_calls.append((ticket, error))
            self.cond.notify_all()

    def log(self, kind, **fields):
        with self.cond:
            self.events.append((kind, fields))
            self.cond.notify_all()

    def wait(self, pred, timeout_s=20.0):
        with self.cond:
            assert self.cond.wait_for(pred, timeout=timeout_s), "timed out"


def _manifest(version=3, nbytes=3 * 2**20 + 77, k=5, seed=0):
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    buffer, index = flat.flatten({"w": data, "b": data[:1000].view(np.int8)})
    return flat.make_manifest(version, buffer, index, k), buffer


def test_manifest_json_round_trip_is_exact():
    manifest, _ = _manifest()
    assert stream.manifest_from_json(stream.manifest_to_json(manifest)) == manifest


def test_link_delivers_chunks_in_order_with_headers_of_the_manifest():
    manifest, buffer = _manifest()
    sink = Sink(buffer.size)
    server = stream.StreamServer(sink, HOST, timeout_s=5.0, token=TOKEN)
    events, fallback = [], []
    link = stream.StreamLink("relay", server.address, timeout_s=5.0, token=TOKEN,
                             log=lambda kind, **f: events.append(kind),
                             fallback=lambda *a: fallback.append(a))
    done = []
    try:
        order = [2, 0, 4, 1, 3]
        for i in order:
            s, e = manifest.chunks[i]
            link.send(manifest, i, buffer[s:e], lambda i=i: done.append(i))
        sink.wait(lambda: len(sink.got) == len(order))
    finally:
        link.close()
        server.close()
    assert np.array_equal(sink.buffer, buffer)
    got = [(m.version, h.chunk, h.offset, h.length, h.crc32) for m, h in sink.got]
    assert got == [(3, i, manifest.chunks[i][0], manifest.chunks[i][1] - manifest.chunks[i][0],
                    manifest.checksums[i]) for i in order]
    assert all(m == manifest for m, _ in sink.got)   # the manifest crossed the wire intact
    assert done == order and events == [] and fallback == []


def test_connection_closed_mid_chunk_is_lost_and_logged_not_hung():
    manifest, buffer = _manifest()
    sink = Sink(buffer.size)
    server = stream.StreamServer(sink, HOST, timeout_s=5.0, token=TOKEN)
    try:
        sock = stream.connect(server.address, 5.0, TOKEN)
        stream.write_manifest(sock, manifest)
        s, e = manifest.chunks[1]
        sock.sendall(stream._HEADER.pack(stream.MAGIC, stream.CHUNK, 3, 1, s, e - s,
                                         manifest.checksums[1]))
        sock.sendall(buffer[s:s + (e - s) // 2])
        sock.close()
        sink.wait(lambda: sink.lost_calls and any(k == "stream_error" for k, _ in sink.events))
    finally:
        server.close()
    assert sink.got == []
    (ticket, error), = sink.lost_calls
    assert ticket[1].chunk == 1 and f"after {(e - s) // 2} of {e - s} bytes" in error


def test_a_stalled_reader_times_out_the_sender_which_falls_back():
    """A peer that accepts but never reads: each send gives up after timeout_s, the link retries
    once on a new connection, then logs stream_fallback and hands the chunk to the fallback."""
    listener = socket.create_server((HOST, 0))
    manifest, _ = _manifest(nbytes=64 * 2**20, k=1)   # more than the socket buffers hold
    data = np.zeros(manifest.total_bytes, np.uint8)
    events, fallback, done = [], [], threading.Event()
    start = time.monotonic()
    link = stream.StreamLink("relay", listener.getsockname(), timeout_s=0.5,
                             log=lambda kind, **f: events.append((kind, f)),
                             fallback=lambda m, i, view: fallback.append((m.version, i, view.size)))
    try:
        link.send(manifest, 0, data, done.set)
        assert done.wait(20.0)
    finally:
        link.close()
        listener.close()
    assert time.monotonic() - start < 20.0
    kinds = [k for k, _ in events]
    assert kinds == ["stream_error", "stream_error", "stream_fallback"]
    assert [f["retry"] for k, f in events[:2]] == [True, False]
    assert "timed out" in events[0][1]["error"]
    assert fallback == [(3, 0, data.size)]


def test_bad_frames_are_logged_and_the_server_keeps_serving():
    manifest, buffer = _manifest()
    sink = Sink(buffer.size)
    server = stream.StreamServer(sink, HOST, timeout_s=5.0, token=TOKEN)
    try:
        bad = stream.connect(server.address, 5.0, TOKEN)
        bad.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 64)
        # a connection without the group's token gets nothing in, whatever it sends
        stranger = stream.connect(server.address, 5.0, "another-run")
        s, e = manifest.chunks[0]
        try:
            stream.write_manifest(stranger, manifest)
            stream.write_chunk(stranger, manifest, 0, buffer[s:e])
        except ConnectionError:
            pass   # the server may already have dropped the connection
        sink.wait(lambda: any("token" in f.get("error", "") for _, f in sink.events))
        assert sink.got == []
        sink.wait(lambda: any("bad frame header" in f.get("error", "") for _, f in sink.events))
        # a chunk before its manifest is dropped; the frames after it on the connection count
        sock = stream.connect(server.address, 5.0, TOKEN)
        s, e = manifest.chunks[0]
        stream.write_chunk(sock, manifest, 0, buffer[s:e])
        stream.write_manifest(sock, manifest)
        stream.write_chunk(sock, manifest, 0, buffer[s:e])
        sink.wait(lambda: len(sink.got) == 1)
        sock.close()
    finally:
        server.close()
    errors = [f["error"] for k, f in sink.events if k == "stream_error"]
    assert any("bad frame header" in x for x in errors)
    assert any("token does not match" in x for x in errors)
    assert "chunk before its version's manifest" in errors
    assert np.array_equal(sink.buffer[s:e], buffer[s:e])


def _shared_copy(buffer):
    shared = shared_buffer.SharedBuffer(buffer.size)
    shared.array[:] = buffer
    return shared


@pytest.mark.skipif(not shared_buffer.available(), reason="needs memfd_create and /proc")
def test_same_host_link_sends_chunk_at_frames_and_the_receiver_copies_from_the_source():
    manifest, buffer = _manifest()
    shared = _shared_copy(buffer)
    sink = Sink(buffer.size)
    server = stream.StreamServer(sink, HOST, timeout_s=5.0, token=TOKEN)
    events = []
    link = stream.StreamLink("relay", server.address, timeout_s=5.0, token=TOKEN,
                             log=lambda kind, **f: events.append(kind),
                             fallback=lambda *a: events.append("fallback"), same_host=True)
    try:
        for i in (1, 0, 4, 2, 3):
            s, e = manifest.chunks[i]
            link.send(manifest, i, shared.array[s:e], source=shared.handle)
        sink.wait(lambda: len(sink.got) == manifest.num_chunks)
    finally:
        link.close()
        server.close()
    assert np.array_equal(sink.buffer, buffer) and events == []
    assert {h.kind for _, h in sink.got} == {stream.CHUNK_AT}
    assert [(h.chunk, h.offset, h.crc32) for _, h in sink.got] == [
        (i, manifest.chunks[i][0], manifest.checksums[i]) for i in (1, 0, 4, 2, 3)]


@pytest.mark.skipif(not shared_buffer.available(), reason="needs memfd_create and /proc")
def test_chunk_at_without_a_mappable_source_is_logged_and_the_connection_goes_on():
    manifest, buffer = _manifest()
    released = _shared_copy(buffer)
    handle = released.handle
    released.release()                # superseded before the receiver mapped it
    live = _shared_copy(buffer)
    sink = Sink(buffer.size)
    server = stream.StreamServer(sink, HOST, timeout_s=5.0, token=TOKEN)
    try:
        sock = stream.connect(server.address, 5.0, TOKEN)
        stream.write_manifest(sock, manifest)
        stream.write_chunk_at(sock, manifest, 0)              # no source named yet
        stream.write_source(sock, manifest.version, handle)
        stream.write_chunk_at(sock, manifest, 1)              # source released
        stream.write_source(sock, manifest.version, live.handle)
        stream.write_chunk_at(sock, manifest, 2)              # this one lands
        sink.wait(lambda: len(sink.got) == 1)
        # a chunk-at frame pointing outside the source buffer drops the connection
        small = shared_buffer.SharedBuffer(1024)
        stream.write_source(sock, manifest.version, small.handle)
        stream.write_chunk_at(sock, manifest, 3)
        sink.wait(lambda: any("outside the source" in f.get("error", "") for _, f in sink.events))
        sock.close()
    finally:
        server.close()
    assert [h.chunk for _, h in sink.got] == [2]
    s, e = manifest.chunks[2]
    assert np.array_equal(sink.buffer[s:e], buffer[s:e])
    errors = [f.get("error", "") for k, f in sink.events if k == "stream_error"]
    assert errors[0] == "no mapped source buffer for this version"
    assert "source buffer not mapped: BufferGone" in errors[1]


def _wait_until(pred, timeout_s):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_idle_and_half_open_connections_are_closed_and_threads_stay_bounded():
    """200 connections that never greet (a port scan, half-open peers): each is closed after the
    stream timeout, at most max_connections are served at once, and the threads go back down."""
    sink = Sink(16)
    before = threading.active_count()
    server = stream.StreamServer(sink, HOST, timeout_s=1.0, token=TOKEN, max_connections=20)
    socks = []
    try:
        for _ in range(200):
            socks.append(socket.create_connection(server.address, timeout=5))
        peak = threading.active_count() - before
        assert server.connections() <= 20
        assert peak <= 20 + 2, peak        # accept thread + at most max_connections readers
        assert _wait_until(lambda: server.connections() == 0, 10.0), server.connections()
        # every one of them was closed by the server: a read sees EOF (or a reset), never blocks
        for s in socks:
            s.settimeout(5)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        assert _wait_until(lambda: threading.active_count() <= before + 1, 5.0)
        kinds = [k for k, _ in sink.events]
        assert server.refused > 0
        assert 1 <= kinds.count("stream_refused") <= 3       # rate-limited, not one per refusal
        assert kinds.count("stream_error") <= 200 - server.refused   # one per timed-out connection
    finally:
        for s in socks:
            s.close()
        server.close()


def test_greeted_idle_link_is_closed_by_the_server_and_the_link_reconnects_to_send():
    manifest, buffer = _manifest(nbytes=4096, k=2)
    sink = Sink(buffer.size)
    server = stream.StreamServer(sink, HOST, timeout_s=5.0, token=TOKEN, idle_timeout_s=0.5)
    events = []
    link = stream.StreamLink("relay", server.address, timeout_s=5.0, token=TOKEN, idle_timeout_s=0.5,
                             log=lambda kind, **f: events.append(kind), fallback=lambda *a: events.append("fb"))
    try:
        s, e = manifest.chunks[0]
        link.send(manifest, 0, buffer[s:e])
        sink.wait(lambda: len(sink.got) == 1)
        assert _wait_until(lambda: server.connections() == 0, 5.0)   # idle: closed by the server
        s, e = manifest.chunks[1]
        link.send(manifest, 1, buffer[s:e])                          # after the idle close
        sink.wait(lambda: len(sink.got) == 2)
    finally:
        link.close()
        server.close()
    assert np.array_equal(sink.buffer, buffer)
    assert "fb" not in events and "stream_fallback" not in events
