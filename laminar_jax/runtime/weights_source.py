"""Where a rollout gets newer weights: its node's relay, or the weight store (relays off).

    newer_than(version)             -> (version, tensors) | None      answers at once
    wait_newer(version, timeout_s)  -> (version, tensors) | None      blocks until newer or timeout

tensors in the engine layout (Hugging Face names and shapes). With relays, the flat buffer is
mapped read-only from the relay's shared memory (or this node's object store) without a copy
(`weights.relay.read`); without, the rollout restores the orbax checkpoint itself, which is the
ablation of the paper's relay tier (section 4.1: storage on every rollout's critical path).

A rollout asks `newer_than` on every loop turn it may load weights. `RelaySource` answers that
from a version number a watcher thread keeps: one long-poll (`RelayWorker.wait_newer`) per version
instead of an RPC per turn, and the buffer is mapped only when a newer version exists. An idle
rollout blocks in `wait_newer` instead of spinning.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import ray

# the watcher's long-poll: short enough that a relay replaced after a failure is found again soon
WATCH_POLL_S = 10.0
# relays off: how often an idle rollout lists the weight store while it waits
STORE_POLL_S = 0.05


class WeightSource:
    def newer_than(self, version: int) -> tuple[int, dict] | None:
        raise NotImplementedError

    def wait_newer(self, version: int, timeout_s: float) -> tuple[int, dict] | None:
        """`newer_than`, waiting up to `timeout_s` for a newer version (default: re-asks every
        STORE_POLL_S; sources that can be told override it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.newer_than(version)
            left = deadline - time.monotonic()
            if got is not None or left <= 0:
                return got
            time.sleep(min(STORE_POLL_S, left))

    def node(self) -> str | None:
        """The node the weights come from (the relay's, or the store's)."""
        return None


class RelaySource(WeightSource):
    """The relay on this rollout's node (`weights.relay_group.local_relay`)."""

    def __init__(self, prefix: str, namespace: str | None = None):
        self.prefix, self.namespace = prefix, namespace
        self._relay, self._node = None, None
        self._cond: threading.Condition | None = None   # made in the actor (not picklable)
        self._served = -1                                # newest version the relay served
        self.rpcs = 0                                    # relay calls made (tests count them)

    def __getstate__(self):
        return {"prefix": self.prefix, "namespace": self.namespace}

    def __setstate__(self, state):
        self.__init__(state["prefix"], state["namespace"])

    def node(self) -> str | None:
        if self._node is None and self._relay is not None:
            self._node = ray.get(self._relay.node_id.remote(), timeout=30)
        return self._node

    def _handle(self):
        from laminar_jax.weights.relay_group import local_relay
        if self._relay is None:
            self._relay = local_relay(self.prefix, self.namespace)
        return self._relay

    def _start_watcher(self) -> None:
        if self._cond is None:
            self._cond = threading.Condition()
            threading.Thread(target=self._watch, name="relay-watch", daemon=True).start()

    def _watch(self) -> None:
        """Long-polls the relay for the next served version and records its number."""
        while True:
            try:
                relay = self._handle()
                self.rpcs += 1
                snap = ray.get(relay.wait_newer.remote(self._served, WATCH_POLL_S), timeout=WATCH_POLL_S + 60)
            except Exception:  # noqa: BLE001 - relay restarting or gone: look it up again
                self._relay = None
                time.sleep(0.5)
                continue
            if snap is not None:
                with self._cond:
                    self._served = max(self._served, snap.version)
                    self._cond.notify_all()

    def _pull(self, version: int) -> tuple[int, dict] | None:
        from laminar_jax.weights import flat
        from laminar_jax.weights.relay import pull

        self.rpcs += 1
        got = pull(self._handle(), newer_than=version, timeout_s=0.0)
        if got is None or got[0] <= version:
            return None
        return got[0], flat.unflatten(got[1], got[2])

    def newer_than(self, version: int) -> tuple[int, dict] | None:
        self._start_watcher()
        with self._cond:
            if self._served <= version:
                return None
        return self._pull(version)

    def wait_newer(self, version: int, timeout_s: float) -> tuple[int, dict] | None:
        self._start_watcher()
        with self._cond:
            self._cond.wait_for(lambda: self._served > version, timeout=timeout_s)
            if self._served <= version:
                return None
        return self._pull(version)


class StoreSource(WeightSource):
    """Reads the newest finalized version straight from the learner's weight store."""

    def __init__(self, store: Any, model_cfg: Any):
        self.store, self.model_cfg = store, model_cfg

    def node(self) -> str | None:
        return self.store.node_id

    def newer_than(self, version: int) -> tuple[int, dict] | None:
        from laminar_jax.models.hf import params_to_hf
        from laminar_jax.weights.publish import read_version

        versions = self.store.versions()
        if not versions or versions[-1] <= version:
            return None
        try:
            tree = read_version(self.store, versions[-1])
        except (FileNotFoundError, ValueError):  # pruned or replaced while reading: next poll
            return None
        return versions[-1], params_to_hf(self.model_cfg, tree)
