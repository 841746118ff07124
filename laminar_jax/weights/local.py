"""`InProcessWeights`: the weight path of a colocated run (`run.colocate`), in memory.

The learner and its one rollout share a process there, so a version goes from the learner's
`publish` straight to the rollout's `newer_than` / `wait_newer`: no weight store, no orbax
write, no relay. `publish` makes the same host copy in the same dtype as `Publisher.publish`
(params cast to `model.rollout_dtype`, owned by numpy: the next update donates the learner's
buffers), and the rollout gets them in the engines' Hugging Face layout (`params_to_hf`), as
`StoreSource` serves them. Only the newest version is kept: a rollout loads the newest.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from laminar_jax.weights.publish import check_next_version
from laminar_jax.weights.source import WeightSource


class InProcessWeights(WeightSource):
    """Publisher (learner side) and weight source (rollout side) of one process."""

    def __init__(self, model_cfg: Any, dtype: str):
        import jax
        import jax.numpy as jnp

        self.model_cfg = model_cfg
        target = jnp.dtype(dtype)   # bfloat16 too
        self._cast = jax.jit(lambda tree: jax.tree.map(lambda x: x.astype(target), tree))
        self._cond = threading.Condition()
        self._version: int | None = None
        self._tree: dict | None = None
        self._hf: tuple[int, dict] | None = None   # the newest version in HF layout, made once

    # ------------------------------------------------------------------ learner side
    def publish(self, version: int, params: Any) -> None:
        """Makes `params` version `version`; returns once the rollout can read it."""
        check_next_version("InProcessWeights.publish", version, self._version)
        import jax

        tree = params.to_pure_dict() if hasattr(params, "to_pure_dict") else params
        host = jax.tree.map(np.array, self._cast(tree))
        with self._cond:
            self._version, self._tree = version, host
            self._cond.notify_all()

    def set_master(self, master: Any) -> None:   # noqa: ARG002 - no relays in one process
        raise RuntimeError("InProcessWeights: a colocated run has no relays")

    def close(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ rollout side
    def newest_published(self) -> int | None:
        return self._version

    def newer_than(self, version: int) -> tuple[int, dict] | None:
        from laminar_jax.models.hf import params_to_hf

        with self._cond:
            if self._version is None or self._version <= version:
                return None
            newest, tree = self._version, self._tree
        if self._hf is None or self._hf[0] != newest:
            self._hf = (newest, params_to_hf(self.model_cfg, tree))
        return self._hf

    def wait_newer(self, version: int, timeout_s: float) -> tuple[int, dict] | None:
        """`newer_than`, woken by the learner's publish (no polling)."""
        with self._cond:
            self._cond.wait_for(lambda: self._version is not None and self._version > version, timeout=timeout_s)
        return self.newer_than(version)
