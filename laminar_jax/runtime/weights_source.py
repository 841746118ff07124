"""Where a rollout gets newer weights: its node's relay, or the weight store (relays off).

`newer_than(version) -> (version, tensors) | None`, tensors in the engine layout (Hugging Face
names and shapes). With relays, the flat buffer is mapped read-only from the relay's shared memory
(or this node's object store) without a copy (`weights.relay.read`); without, the rollout restores the orbax checkpoint itself, which is the
ablation of the paper's relay tier (section 4.1: storage on every rollout's critical path).
"""
from __future__ import annotations

from typing import Any

import ray


class WeightSource:
    def newer_than(self, version: int) -> tuple[int, dict] | None:
        raise NotImplementedError

    def node(self) -> str | None:
        """The node the weights come from (the relay's, or the store's)."""
        return None


class RelaySource(WeightSource):
    """The relay on this rollout's node (`weights.relay_group.local_relay`)."""

    def __init__(self, prefix: str, namespace: str | None = None):
        self.prefix, self.namespace = prefix, namespace
        self._relay, self._node = None, None

    def node(self) -> str | None:
        if self._node is None and self._relay is not None:
            self._node = ray.get(self._relay.node_id.remote())
        return self._node

    def newer_than(self, version: int) -> tuple[int, dict] | None:
        from laminar_jax.weights import flat
        from laminar_jax.weights.relay import pull
        from laminar_jax.weights.relay_group import local_relay

        if self._relay is None:
            self._relay = local_relay(self.prefix, self.namespace)
        got = pull(self._relay)
        if got is None or got[0] <= version:
            return None
        return got[0], flat.unflatten(got[1], got[2])


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
