"""A relay's links to its downstream relays: forwarding, resends, and the hold drill.

Each downstream relay gets a `stream.StreamLink` when both ends use the tcp transport, else a
`StoreLink` (the chunk is `ray.put` here and `offer`ed: the next hop pulls it from this node's
object store; one object serves every object-store link of a fan-out). A stream that cannot be
opened falls back to the object store ("stream_fallback"), and so does one that fails while
sending (`stream.StreamLink`). A stream to a relay on this host (equal `shared_buffer.host_key`,
both ends with shared buffers) sends chunk-at frames: the bytes are copied from this relay's
shared version buffer, not sent over the socket.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import numpy as np
import ray

from laminar_jax.weights import flat, stream
from laminar_jax.weights.shared_buffer import BufferHandle
from laminar_jax.weights.relay_state import Arrival

__all__ = ["Downstream", "StoreLink"]


@dataclasses.dataclass(frozen=True)
class StoreLink:
    relay: Any
    address: None = None

    def close(self) -> None:
        pass


class Downstream:
    """Links of one relay. `tcp`: open streams to relays that listen; `timeout_s`: stream
    connect/send limit and the wait for a relay's address; `token`: the group's stream token;
    `host_key`: this relay's `shared_buffer.host_key()` when its version buffers are shared."""

    def __init__(self, *, tcp: bool, timeout_s: float, log: Callable[..., None], token: str = "",
                 host_key: str | None = None, idle_timeout_s: float = stream.IDLE_TIMEOUT_S):
        self._tcp, self._timeout_s, self._log, self._token = tcp, timeout_s, log, token
        self._idle_timeout_s = idle_timeout_s
        self._host_key = host_key
        self.links: tuple = ()
        self._pending: list = []     # results of offers sent downstream, reaped as they finish
        self._lock = threading.Lock()
        self._hold_after: int | None = None
        self._forwarded = 0
        self._released = threading.Event()

    def __len__(self) -> int:
        return len(self.links)

    def relink(self, relays: tuple) -> None:
        """Links to `relays` (existing streams to the same address are kept, others closed)."""
        old = {link.address: link for link in self.links if link.address is not None}
        links = tuple(self._link_to(relay, old) for relay in relays)
        for link in old.values():
            if link not in links:
                link.close()
        self.links = links

    def _link_to(self, relay: Any, old: dict) -> Any:
        if not self._tcp:
            return StoreLink(relay)
        try:
            address = ray.get(relay.stream_address.remote(), timeout=self._timeout_s)
            peer_key = ray.get(relay.host_key.remote(), timeout=self._timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead relay: the heartbeat cuts it out
            self._log("relay_error", message="relink", error=repr(e))
            return StoreLink(relay)
        if address is None:       # that relay uses the object store
            return StoreLink(relay)
        address = tuple(address)
        if address in old:
            return old[address]
        try:
            return stream.StreamLink(
                relay, address, timeout_s=self._timeout_s, log=self._log, token=self._token,
                idle_timeout_s=self._idle_timeout_s,
                fallback=lambda m, i, view: self.offer(relay, m, i, ray.put(view)),
                same_host=self._host_key is not None and peer_key == self._host_key)
        except OSError as e:
            where = f"{address[0]}:{address[1]}"
            self._log("stream_error", to=where, where="connect", error=repr(e))
            self._log("stream_fallback", to=where)
            return StoreLink(relay)

    def forward(self, manifest: flat.Manifest, i: int, data: np.ndarray,
                owner: Arrival | None = None, source: BufferHandle | None = None) -> None:
        """Chunk `i` to every link. `owner`: the arrival whose buffer `data` views (counted
        until the streams have sent it, so the buffer is not reused meanwhile); `source`: the
        shared buffer `data` lies in (same-host streams send a chunk-at frame instead)."""
        if self._hold_after is not None and self._forwarded >= self._hold_after:
            if not self._released.wait(self._timeout_s):   # a drill never blocks a relay for good
                self._log("relay_error", message="hold not released", timeout_s=self._timeout_s)
                self._hold_after = None
        self._forwarded += 1
        ref = None
        for link in self.links:
            if link.address is None:
                ref = ray.put(data) if ref is None else ref
                self.offer(link.relay, manifest, i, ref)
            else:
                self.send(link, manifest, i, data, owner, source)

    def send(self, link: Any, manifest: flat.Manifest, i: int, data: np.ndarray,
             owner: Arrival | None = None, source: BufferHandle | None = None) -> None:
        """Chunk `i` to one link."""
        if link.address is None:
            self.offer(link.relay, manifest, i, ray.put(data))
            return
        done = None
        if owner is not None:
            with self._lock:
                owner.sending += 1

            def done() -> None:
                with self._lock:
                    owner.sending -= 1
        link.send(manifest, i, data, done, source)

    def offer(self, relay: Any, manifest: flat.Manifest, i: int, ref: Any) -> None:
        with self._lock:
            self._pending.append(relay.offer.remote(manifest, i, [ref]))
            done, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        for result in done:   # collect errors of offers to dead relays so Ray does not warn
            try:
                ray.get(result, timeout=0)   # ready: answers at once
            except Exception:  # noqa: BLE001 - the heartbeat reports dead relays
                pass

    def hold(self, after_chunks: int) -> None:
        """Fault drill: stop forwarding after `after_chunks` more chunks until `release()`."""
        self._released.clear()
        self._hold_after = self._forwarded + after_chunks

    def release(self) -> None:
        self._hold_after = None
        self._released.set()
