"""A relay's version bookkeeping (`weights.relay_state.Versions`) with shared buffers, without Ray:
a version arriving from a same-host upstream shares the upstream's buffer; a chunk of it that
comes another way turns it into a private copy, with every byte in place."""
import numpy as np
import pytest

from laminar_jax.weights import flat, shared_buffer
from laminar_jax.weights.relay_state import Served, Versions
from laminar_jax.weights.stream import Source

pytestmark = pytest.mark.skipif(not shared_buffer.available(), reason="needs memfd_create and /proc")
K = 4


def _upstream(seed=0, nbytes=2**20 + 3):
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    buffer, index = flat.flatten({"w": data})
    manifest = flat.make_manifest(7, buffer, index, K)
    up = shared_buffer.SharedBuffer(buffer.size)
    up.array[:] = buffer
    return manifest, up


def _versions():
    events = []
    pool = shared_buffer.BufferPool()
    return Versions(lambda kind, **f: events.append((kind, f)), keep_spare=False,
                    allocate=pool.take), events


def _receive(versions, manifest, i, source=None, data=None):
    arrival, state = versions.claim(manifest, i, source=source)
    assert state == "direct"
    s, e = manifest.chunks[i]
    if data is not None:
        arrival.buffer[s:e] = data[s:e]
    assert versions.done_receiving(arrival, i)
    assert flat.check_chunk(manifest, i, arrival.buffer[s:e]) is None
    return arrival, versions.accept(arrival, i, "shared_memory" if source else "tcp")


def test_a_same_host_version_is_shared_not_copied_and_outlives_its_upstream():
    manifest, up = _upstream()
    want = up.array.copy()
    versions, events = _versions()
    source = Source(up.handle, shared_buffer.open_handle(up.handle))
    for i in range(K):
        arrival, done = _receive(versions, manifest, i, source=source)
    assert done and np.shares_memory(arrival.buffer, source.array)
    assert not arrival.shared.writable and arrival.shared.handle.inode == up.handle.inode
    assert arrival.shared.handle.fd != up.handle.fd      # an fd of its own
    versions.serve(manifest, Served(arrival.buffer, arrival.shared), arrival)
    up.release()                        # the upstream moves on (or dies)
    del up
    # this relay's own fd keeps the version mappable for its rollouts
    served = versions.current[1]
    assert np.array_equal(shared_buffer.open_handle(served.shared.handle), want)
    assert [k for k, _ in events] == []


def test_a_chunk_that_comes_another_way_makes_the_version_private_with_every_byte():
    manifest, up = _upstream(seed=1)
    want = up.array.copy()
    versions, events = _versions()
    source = Source(up.handle, shared_buffer.open_handle(up.handle))
    _receive(versions, manifest, 0, source=source)
    _receive(versions, manifest, 1, source=source)
    # chunk 2 arrives as bytes (a stream from another host, or the object store)
    arrival, done = _receive(versions, manifest, 2, data=want)
    assert not done and arrival.shared.writable
    assert not np.shares_memory(arrival.buffer, source.array)
    # the rest arrives as chunk-at frames again: copied into the private buffer now
    arrival, state = versions.claim(manifest, 3, source=source)
    assert state == "direct" and arrival.buffer.flags.writeable
    s, e = manifest.chunks[3]
    arrival.buffer[s:e] = source.array[s:e]
    assert versions.done_receiving(arrival, 3) and versions.accept(arrival, 3, "shared_memory")
    assert np.array_equal(arrival.buffer, want)
    assert [(k, f["chunks"]) for k, f in events] == [("version_privatized", 2)]


def test_a_relay_wait_without_a_limit_still_ends(monkeypatch):
    """`RelayWorker.wait_newer(version, None)` waits at most MAX_WAIT_S inside the relay, so a
    caller that gave up (its ray.get timed out) never pins one of the actor's threads for good."""
    import time

    from laminar_jax.weights import relay
    monkeypatch.setattr(relay, "MAX_WAIT_S", 0.2)
    worker = relay.RelayWorker("n0", transport="object_store", shared_memory=False)
    t0 = time.monotonic()
    assert worker.wait_newer(-1, None) is None and worker.wait_newer(-1, 30.0) is None
    assert time.monotonic() - t0 < 5.0
