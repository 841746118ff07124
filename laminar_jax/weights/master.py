"""The master relay's own step: a published checkpoint -> checksummed engine-layout chunks.

Laminar §4.2, Fig 6 ("Concat", "Reshard"): the master gathers the learner's partitions and lays
them out as the rollouts load them. Here: orbax restores the checkpoint to host numpy whatever mesh
wrote it (`publish.read_path`; a multi-host learner's per-host shards are assembled and
checksummed by `host_shards.assemble`, and a host's missing or torn shard is a `ShardError`),
`flat.params_to_flat` writes the Hugging Face layout into one
buffer, `flat.make_manifest` cuts it into k chunks and checksums each. k comes from the chain time
model (`chain.optimal_chunks`) unless fixed.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from typing import Any, Callable

import numpy as np

from laminar_jax.weights import flat
from laminar_jax.weights.chain import optimal_chunks

__all__ = ["MasterRole", "prepare", "prepare_pinned", "read_pinned", "pin", "prune"]


@dataclasses.dataclass(frozen=True)
class MasterRole:
    """What the master relay needs to turn a published checkpoint into chunks.

    `chain_length` (relays in the chain, master included), `t_byte` and `t_start` feed
    `chain.optimal_chunks` unless `num_chunks` fixes k. Chunks are also kept under
    `max_chunk_bytes`: the time model counts only transfers, but each relay also checks and copies
    a chunk, and it overlaps that with fetching the next one only if there is a next one (the
    optimum for p = 2 is a single chunk); it also bounds the object-store slack per message.
    """

    store: Any                     # publish.WeightStore
    cfg: Any                       # models.config.DecoderConfig
    chain_length: int
    num_chunks: int | None = None
    t_byte: float = 1e-9           # Ray object transfer between nodes: ~1 GB/s (environment.md)
    t_start: float = 2e-3          # per chunk: a put, an actor call and a pull
    max_chunks: int = 256
    max_chunk_bytes: int = 64 * 2**20
    workers: int = dataclasses.field(default_factory=lambda: min(4, os.cpu_count() or 1))

    def chunks_for(self, model_bytes: int) -> int:
        if self.num_chunks is not None:
            return max(1, min(self.num_chunks, model_bytes))
        k = optimal_chunks(self.chain_length, model_bytes, self.t_byte, self.t_start,
                           max_chunks=self.max_chunks)
        return max(k, min(-(-model_bytes // self.max_chunk_bytes), self.max_chunks))


def prepare(role: MasterRole, version: int, path: str, *,
            allocate: Callable[[int], np.ndarray] | None = None
            ) -> tuple[flat.Manifest, np.ndarray, dict[str, float]]:
    """(manifest, flat buffer, seconds spent reading / converting / checksumming). `allocate(n)`
    gives the buffer to convert into (the relay's shared buffer, which it then serves as is)."""
    from laminar_jax.weights import publish   # imports orbax and jax: only masters pay for it

    t0 = time.perf_counter()
    params = publish.read_path(role.store, path)
    t1 = time.perf_counter()
    buffer, index = flat.params_to_flat(role.cfg, params, workers=role.workers, allocate=allocate)
    del params
    t2 = time.perf_counter()
    manifest = flat.make_manifest(version, buffer, index, role.chunks_for(buffer.size))
    t3 = time.perf_counter()
    return manifest, buffer, {"read_s": t1 - t0, "convert_s": t2 - t1, "checksum_s": t3 - t2}


def prune(role: MasterRole, version: int) -> list[int]:
    """Deletes the store's versions older than `version`, now that the master holds it. The
    newest stays: a master elected after a failure restores it from there.

    A store folder this process sees is pruned here, as `publish.read_path` reads it: a master
    promoted on another node of the same host (or on a shared file system) would otherwise
    prune through a task on the store's node, whose first call starts a Ray worker process --
    seconds of CPU, measured 3.1 s, taken from the rollouts loading the failover's first version.
    The store root is unique per learner process, so a visible root is the store's."""
    store = role.store
    if os.path.isdir(store.root):
        removed = [v for v in store.versions() if v < version]
        for v in removed:
            store.delete(v)
        if not store.shared:   # one host's tmpfs: a pin's pid is a process of this host
            _remove_dead_pins(store.root)
        return removed
    from laminar_jax.weights import publish
    return publish.prune_store(store, version)


# a pin's name: the version's, its reader (the standby, a rollout's StoreSource, a prune in
# progress: `WeightStore.delete`) and the reader's pid
_PIN = re.compile(r"^v\d{10}\.(?:standby|reader|pruned)-(\d+)$")


def _remove_dead_pins(root: str) -> None:
    """Pins a killed reader left (each holds a version's data while its links last)."""
    for name in os.listdir(root):
        m = _PIN.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except PermissionError:   # alive, another user's
            pass


def pin(store: Any, version: int, reader: str = "standby") -> str | None:
    """A private copy of `version`'s folder made of hard links (no bytes copied), beside it in
    the store: `v{version}.{reader}-{pid}`; None when the version is gone (pruned meanwhile).

    A reader other than the master (the standby following the store, a rollout reading the
    store because no relay answers) may find the version it reads pruned by the master under
    it, once the master has taken a newer one. Orbax then fails half-way, and tensorstore's
    reads still in flight complete on orbax's closed event loop ("Event loop is closed"
    tracebacks). Files keep their data while a link is left, so reading the pinned copy never
    races the prune. The copy is whole or None: a prune first renames the version's folder
    (`WeightStore.delete`), so a link made after that fails instead of missing a file. The name
    matches the store's entries (`run_folder` removes a pin a killed reader left with its
    store, and so does the next prune on its host); `store.versions()` skips it."""
    src = store.path(version)
    dst = f"{src}.{reader}-{os.getpid()}"
    shutil.rmtree(dst, ignore_errors=True)

    def fail(error: OSError) -> None:
        raise error
    try:
        for top, _, files in os.walk(src, onerror=fail):
            rel = os.path.relpath(top, src)
            os.makedirs(os.path.join(dst, rel), exist_ok=True)
            for name in files:
                os.link(os.path.join(top, name), os.path.join(dst, rel, name))
        if not os.path.isdir(src):   # pruned before its folder was listed: an empty copy
            raise FileNotFoundError(src)
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        return None
    return dst


def prepare_pinned(role: MasterRole, version: int, *,
                   allocate: Callable[[int], np.ndarray] | None = None
                   ) -> tuple[flat.Manifest, np.ndarray, dict[str, float]] | None:
    """`prepare` of a version this process does not own (the store is visible here), read from
    a pinned copy (`pin`); None when the version was pruned before it could be pinned."""
    path = pin(role.store, version)
    if path is None:
        return None
    try:
        return prepare(role, version, path, allocate=allocate)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def read_pinned(store: Any, version: int) -> dict | None:
    """Host numpy params of `version` (as `publish.read_version`), read from a pin so that the
    master's prune cannot pull files from under the read; None when it was pruned before it
    could be pinned. Read through a task on the store's node when this process cannot see it."""
    from laminar_jax.weights import publish
    if os.path.isdir(store.root):
        return _read_pinned_here(store, version)
    return publish._on_store_node(store, _read_pinned_here, store, version)


def _read_pinned_here(store: Any, version: int) -> dict | None:
    from laminar_jax.weights import publish
    path = pin(store, version, reader="reader")
    if path is None:
        return None
    try:
        return publish.read_path(store, path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
