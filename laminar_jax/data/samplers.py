"""Pluggable experience-buffer samplers and eviction policies.

The buffer keeps its groups in arrival order and hands the policies that list (objects with
`group_id`, `seq` (arrival number), `gen_version` (oldest token version in the group) and
`trajectories`). A sampler picks which groups a learner step gets; an eviction policy picks which
group to drop when a full buffer receives another one, or refuses (back-pressure: `put` returns
False and the producer waits).

Samplers: "fifo" (oldest first; the paper's default, App. A.2), "newest" (newest first), "uniform"
(uniformly without replacement, seeded). Evictions: "block" (back-pressure), "drop_oldest",
"drop_stalest" (smallest gen_version, oldest first on ties). Either may also be named by import
path, "pkg.module:Factory", called with `seed=` (samplers) or no argument (evictions).
"""
from __future__ import annotations

import importlib
from typing import Any, Protocol, Sequence

import numpy as np


class Sampler(Protocol):
    def select(self, groups: Sequence[Any], k: int) -> list[int]:
        """Indices of k distinct groups of `groups` (k <= len(groups)), in batch order."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class EvictionPolicy(Protocol):
    def victim(self, groups: Sequence[Any]) -> int | None:
        """Index of the group to drop from a full buffer, or None to refuse the new one."""


class _Stateless:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class FifoSampler(_Stateless):
    def select(self, groups, k):
        return list(range(k))


class NewestSampler(_Stateless):
    def select(self, groups, k):
        n = len(groups)
        return list(range(n - 1, n - 1 - k, -1))


class UniformSampler:
    """Uniform without replacement; the generator state is part of `state_dict`, so a resumed run
    draws the same batches as an uninterrupted one."""

    def __init__(self, seed: int = 0):
        self._rng = np.random.default_rng(seed)

    def select(self, groups, k):
        return [int(i) for i in self._rng.choice(len(groups), size=k, replace=False)]

    def state_dict(self) -> dict:
        return {"bit_generator": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["bit_generator"]


class BlockEviction:
    def victim(self, groups):
        return None


class DropOldestEviction:
    def victim(self, groups):
        return 0


class DropStalestEviction:
    def victim(self, groups):
        return min(range(len(groups)), key=lambda i: (groups[i].gen_version, groups[i].seq))


SAMPLERS = {"fifo": FifoSampler, "newest": NewestSampler, "uniform": UniformSampler}
EVICTIONS = {"block": BlockEviction, "drop_oldest": DropOldestEviction, "drop_stalest": DropStalestEviction}


def _import(spec: str, what: str):
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {spec!r}: cannot import ({type(e).__name__}: {e})") from None


def make_sampler(spec: str | Sampler, seed: int = 0) -> Sampler:
    """A sampler from a built-in name, an import path "pkg.module:Factory", or an instance."""
    if not isinstance(spec, str):
        return spec
    if spec in SAMPLERS:
        return UniformSampler(seed) if spec == "uniform" else SAMPLERS[spec]()
    if ":" in spec:
        return _import(spec, "sampler")(seed=seed)
    raise ValueError(f"sampler {spec!r}: expected one of {sorted(SAMPLERS)} or 'pkg.module:Factory'")


def make_eviction(spec: str | EvictionPolicy) -> EvictionPolicy:
    """An eviction policy from a built-in name, an import path, or an instance."""
    if not isinstance(spec, str):
        return spec
    if spec in EVICTIONS:
        return EVICTIONS[spec]()
    if ":" in spec:
        return _import(spec, "eviction policy")()
    raise ValueError(f"eviction policy {spec!r}: expected one of {sorted(EVICTIONS)} or 'pkg.module:Factory'")
