"""Where a rollout gets newer weights: its node's relay, or the weight store (relays off).

`newer_than(version) -> (version, tensors) | None`, tensors in the engine layout (Hugging Face
names and shapes). With relays, the flat buffer is mapped read-only from the relay's shared memory
(or this node's object store) without a copy (`weights.relay.read`); without, the rollout restores the orbax checkpoint itself, which is the
ablation of the paper's relay tier (section 4.1: storage on every rollout's critical path).
"""
from __future__ import annotations

import time
from typing import Any

import ray


class WeightSource:
    def newer_than(self, version: int) -> tuple[int, dict] | None:
        raise NotImplementedError

    def node(self) -> str | None:
        """The node the weights come from (the relay's, or the store's)."""
        return None


class RelaySource(WeightSource):
    """The relay on this rollout's node (`weights.relay_group.local_relay`), and `fallback` (the
    weight store) while that relay is dead, restarting or not answering within call_timeout_s:
    a relay's death costs its rollouts a slower read, never the rollout. The relay is looked up
    again every retry_s."""

    def __init__(self, prefix: str, namespace: str | None = None, *, fallback: WeightSource | None = None,
                 call_timeout_s: float = 10.0, retry_s: float = 2.0):
        self.prefix, self.namespace = prefix, namespace
        self.fallback, self.call_timeout_s, self.retry_s = fallback, call_timeout_s, retry_s
        self._relay, self._node = None, None
        self._retry_at = 0.0
        self.via = "relay"          # where the last answer came from: "relay" or "store"
        self.fallbacks = 0
        self.last_error: str | None = None

    def node(self) -> str | None:
        if self.via == "store" and self.fallback is not None:
            return self.fallback.node()
        if self._node is None and self._relay is not None:
            try:
                self._node = ray.get(self._relay.node_id.remote(), timeout=self.call_timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return None
        return self._node

    def newer_than(self, version: int) -> tuple[int, dict] | None:
        from laminar_jax.weights import flat
        from laminar_jax.weights.relay import pull
        from laminar_jax.weights.relay_group import local_relay

        if self._relay is None and time.time() < self._retry_at and self.fallback is not None:
            return self._from_store(version)
        try:
            if self._relay is None:
                self._relay, self._node = local_relay(self.prefix, self.namespace), None
            got = pull(self._relay, call_timeout_s=self.call_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ValueError, OSError) as e:
            # dead, restarting, or not registered yet (get_actor's ValueError); OSError: the
            # shared buffer of a relay process that just died cannot be mapped any more
            if self.fallback is None:
                raise
            self._relay, self._retry_at = None, time.time() + self.retry_s
            self.fallbacks += 1
            self.last_error = f"{type(e).__name__}: {e}"
            return self._from_store(version)
        self.via = "relay"
        if got is None or got[0] <= version:
            return None
        return got[0], flat.unflatten(got[1], got[2])

    def _from_store(self, version: int) -> tuple[int, dict] | None:
        self.via = "store"
        return self.fallback.newer_than(version)


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
