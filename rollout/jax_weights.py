"""In-place version switches of the JAX engine: HF-named relay views -> the engine's param leaves.

`WeightPlan(cfg, leaves, entries)` is computed once per engine from a name map: the served one
(`rollout.jax_served.served_map`, the engine's default) or the decoder's (`models.hf.name_map`,
zero-mismatch mode). Per HF tensor it keeps the destination leaf, the layer slot on the stacked
`layers` axis, and whether the copy transposes. A switch then

1. checks every name and shape first (a missing, unexpected or mis-shaped tensor raises
   ValueError naming it, and the engine keeps its weights);
2. writes each tensor once, straight into a host buffer of its leaf's final shape and dtype (two
   sets, used in turn: `WeightPlan.host`): one `np.copyto` into the layer's slot per tensor, a
   plain copy on the served layout (a dtype cast, if the relay serves another dtype, happens in
   the same pass); on the decoder layout the projection kernels take a tiled transposed copy;
3. puts the leaves on the device in one batched `jax.device_put` (a leaf spanning several
   devices onto its sharding); on the CPU backend the aligned host buffers are aliased, no copy.

So on CPU a switch reads the relay's views once and writes each weight once: one plain copy
(`counts`, asserted in tests/rollout/test_jax_weights.py; timed against a plain copy of the buffer
in `experiments/bench_engine.py --switches`). On an accelerator the device_put is the
host-to-device copy, on top of the host copy. The relay's views themselves are never aliased:
the relay reuses its mapped buffer for later versions, which would change the weights under the
engine.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import numpy as np

from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.hf import _IGNORED_SUFFIXES, name_map, np_dtype


@dataclass(frozen=True)
class _Slot:
    """Where one HF tensor goes: leaf path, layer (None: unstacked), the 2-D view of the
    destination slot it is copied into, and whether the copy transposes the HF tensor."""

    hf_name: str
    hf_shape: tuple[int, ...]
    path: tuple[str, ...]
    layer: int | None
    dst_2d: tuple[int, ...]
    transpose: bool


def _slot(entry, leaf_shape: tuple[int, ...]) -> _Slot:
    """The copy for one name-map entry, read off its (exact) `from_hf` transform on a probe:
    a transform is a transpose or a reshape (hf.py), so comparing one index tells which."""
    slot_shape = leaf_shape[1:] if entry.layer is not None else leaf_shape
    if len(entry.hf_shape) == 2:
        probe = np.arange(int(np.prod(entry.hf_shape))).reshape(entry.hf_shape)
        got = np.asarray(entry.from_hf(probe))
        if got.shape != slot_shape:
            raise ValueError(f"weight plan: {entry.hf_name!r} maps to shape {got.shape}, the leaf "
                             f"{'/'.join(entry.path)} slot is {slot_shape}")
        flat = got.reshape(-1)
        if np.array_equal(flat, probe.reshape(-1)):
            return _Slot(entry.hf_name, entry.hf_shape, entry.path, entry.layer, entry.hf_shape, False)
        if np.array_equal(flat, probe.T.reshape(-1)):
            return _Slot(entry.hf_name, entry.hf_shape, entry.path, entry.layer, entry.hf_shape[::-1], True)
        raise ValueError(f"weight plan: {entry.hf_name!r}: transform is neither a reshape nor a transpose")
    return _Slot(entry.hf_name, entry.hf_shape, entry.path, entry.layer, (int(np.prod(entry.hf_shape)),), False)


TILE = 256  # square tiles of a transposed copy: a tile pair stays in cache (numpy's own strided
            # `dst[...] = src.T` streams one side with a cache miss per element: ~2x slower here)


def _transpose_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src.T (cast to dst's dtype), tile by tile."""
    rows, cols = src.shape
    for i in range(0, rows, TILE):
        for j in range(0, cols, TILE):
            np.copyto(dst[j:j + TILE, i:i + TILE], src[i:i + TILE, j:j + TILE].T, casting="unsafe")


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array at a 64-byte aligned address: on the CPU backend `jax.device_put`
    then aliases it instead of copying (checked in tests/rollout/test_jax_weights.py)."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _spread(leaf):
    """The leaf's sharding when it spans several devices, else None: a single-device leaf is
    put uncommitted (as `jnp.asarray` made it), so the jitted steps' cache keys do not change and
    a switch never recompiles."""
    sharding = getattr(leaf, "sharding", None)
    return sharding if sharding is not None and len(sharding.device_set) > 1 else None


def _get(tree: Mapping, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _aliases(array, host: np.ndarray) -> bool:
    """Whether the device array is the host buffer itself (the CPU backend's zero-copy put)."""
    try:
        return array.unsafe_buffer_pointer() == host.ctypes.data
    except Exception:  # noqa: BLE001 - sharded or non-CPU arrays have no single host pointer
        return False


class WeightPlan:
    """`WeightPlan(cfg, leaves, entries=None)`: `leaves` is the engine's params pure dict (shapes,
    dtypes and shardings of the leaves to fill: arrays or `jax.ShapeDtypeStruct`s); `entries` the
    name map onto them (default `models.hf.name_map(cfg)`, the decoder layout; the JAX engine
    passes `rollout.jax_served.served_map(cfg)`). `plan.load(tensors, where=...)` returns a new
    pure dict of device arrays from HF-named tensors, or raises ValueError before anything is
    written. `plan.counts` holds the last load's counted bytes: `host_bytes` written into the
    host buffers (`transposed_bytes` of them by a transposed copy), `device_copy_bytes` that
    `device_put` copied (0 on CPU, where it aliases; the host-to-device copy elsewhere) and
    `param_bytes`, the leaves' size: bytes copied per switch = host + device copy bytes."""

    def __init__(self, cfg: DecoderConfig, leaves: Mapping, entries=None):
        self.cfg = cfg
        entries = name_map(cfg) if entries is None else entries
        self.slots = [_slot(e, tuple(_get(leaves, e.path).shape)) for e in entries]
        self.leaves = {s.path: (tuple(_get(leaves, s.path).shape), np_dtype(_get(leaves, s.path).dtype),
                                _spread(_get(leaves, s.path))) for s in self.slots}
        self._shapes = {s.hf_name: s.hf_shape for s in self.slots}
        self._sets: list[dict | None] = [None, None]   # host buffers, used in turn (see `host`)
        self._dsts: list[list | None] = [None, None]   # per set: each slot's 2-D destination view
        self._turn = 0
        self.counts: dict[str, int] = {}

    def check(self, tensors: Mapping[str, np.ndarray], where: str) -> None:
        """ValueError naming the first missing, unexpected or mis-shaped tensor."""
        missing = [n for n in self._shapes if n not in tensors]
        if missing:
            raise ValueError(f"{where}: missing tensor {missing[0]!r} (expected shape {self._shapes[missing[0]]})"
                             + (f" ({len(missing)} missing in all)" if len(missing) > 1 else ""))
        for name, value in tensors.items():
            if name not in self._shapes:
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                    # a tied head stored explicitly is accepted only if it is the embedding
                    if np.array_equal(np.asarray(value), np.asarray(tensors["model.embed_tokens.weight"])):
                        continue
                    raise ValueError(f"{where}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' "
                                     "but the config has tie_word_embeddings=true")
                raise ValueError(f"{where}: unexpected tensor {name!r} (shape {tuple(np.shape(value))}) "
                                 f"for a {self.cfg.arch} model")
            if tuple(np.shape(value)) != self._shapes[name]:
                raise ValueError(f"{where}: tensor {name!r} has shape {tuple(np.shape(value))}, "
                                 f"expected {self._shapes[name]}")

    def _new_set(self) -> tuple[dict, list]:
        out = {path: _aligned_empty(shape, dtype) for path, (shape, dtype, _) in self.leaves.items()}
        dsts = []
        for s in self.slots:  # views computed once per set: a switch is then one copy call per tensor
            dst = (out[s.path] if s.layer is None else out[s.path][s.layer]).reshape(s.dst_2d)
            assert np.shares_memory(dst, out[s.path]), s.hf_name  # a slot is contiguous: a view
            dsts.append(dst)
        return out, dsts

    def host(self, tensors: Mapping[str, np.ndarray]) -> dict[tuple[str, ...], np.ndarray]:
        """Each leaf as one host array, every tensor written once into its slot.

        Two sets of buffers, used in turn: on CPU the device arrays alias them, so the set being
        written must not be the one the engine's live params use (the other set); a set is
        reused two switches later, when nothing refers to its arrays any more
        (`JaxEngine.load_weights` replaces the params, steps are synchronous). Reusing memory
        matters: first-touch page faults of a fresh 400 MB cost ~2.7 plain copies on this VM."""
        k = self._turn
        if self._sets[k] is None:
            self._sets[k], self._dsts[k] = self._new_set()
        self._turn = 1 - k
        written = transposed = 0
        for s, dst in zip(self.slots, self._dsts[k]):
            src = np.asarray(tensors[s.hf_name])
            if s.transpose:
                _transpose_into(dst, src)
                transposed += dst.nbytes
            else:
                np.copyto(dst, src.reshape(s.dst_2d), casting="unsafe")
            written += dst.nbytes
        self.counts = dict(host_bytes=written, transposed_bytes=transposed)
        return self._sets[k]

    def load(self, tensors: Mapping[str, np.ndarray], *, where: str) -> dict:
        """Checked, assembled on the host, put on the device: the new params pure dict. The
        unsharded leaves go in one batched `device_put` (one call's fixed cost, not one per leaf)."""
        self.check(tensors, where)
        host = self.host(tensors)
        plain = [p for p in host if self.leaves[p][2] is None]
        put = dict(zip(plain, jax.device_put([host[p] for p in plain])))
        for p in host:
            if p not in put:
                put[p] = jax.device_put(host[p], self.leaves[p][2])
        # done reading the host set (an accelerator's copy is asynchronous) before it can be reused
        jax.block_until_ready(list(put.values()))
        self.counts.update(device_copy_bytes=sum(host[p].nbytes for p, a in put.items() if not _aliases(a, host[p])),
                           param_bytes=sum(h.nbytes for h in host.values()))
        tree: dict = {}
        for p, value in put.items():
            _set(tree, p, value)
        return tree
