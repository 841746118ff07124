"""Engine-layout weights as one flat byte buffer plus an index, cut into checksummed chunks.

What a relay holds and sends (Laminar §4.2: the master "concatenates" and "reshards" the learner's
partitions into the rollout layout). The layout here is the Hugging Face one (names, shapes and
dtypes that vLLM's weight reload and the JAX engine both take), produced by the single name map of
`models/hf.py`:

    buffer   uint8 [total_bytes]; tensor j occupies [offset_j, offset_j + nbytes_j), offsets
             aligned to `align` bytes (padding bytes are zero, so equal weights give equal bytes)
    index    (TensorEntry(name, dtype, shape, offset), ...) in name-map order
    chunks   `chain.chunk_bounds(total_bytes, k)`: k contiguous, near-equal byte ranges
    checksum crc32 of each chunk's bytes

A relay accepts a chunk only if it has exactly the chunk's length and crc32; a version is complete
when all k chunks were accepted. `unflatten` gives zero-copy views, so a rollout reading a buffer
from its node's object store copies nothing until it loads the tensors onto its device.

Pure numpy (no jax, Ray, I/O or clock).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from laminar_jax.models import hf
from laminar_jax.models.config import DecoderConfig
from laminar_jax.weights.chain import chunk_bounds

try:   # ISA-L's crc32: the same polynomial and values as zlib's, ~7x faster here (24 vs 3.4 GB/s)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:
    from zlib import crc32 as _crc32

__all__ = [
    "ALIGN",
    "TensorEntry",
    "Manifest",
    "layout",
    "flatten",
    "unflatten",
    "params_to_flat",
    "flat_to_params",
    "checksum",
    "make_manifest",
    "check_chunk",
]

ALIGN = 64  # bytes; cache-line aligned views, and any dtype's itemsize divides it


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one named tensor lives in the flat buffer."""

    name: str
    dtype: str            # numpy dtype name ("bfloat16" through ml_dtypes)
    shape: tuple[int, ...]
    offset: int           # bytes from the start of the buffer

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * hf.np_dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything a relay needs to receive and check one version."""

    version: int
    index: tuple[TensorEntry, ...]
    total_bytes: int
    chunks: tuple[tuple[int, int], ...]   # byte range [start, end) of each chunk
    checksums: tuple[int, ...]            # crc32 of each chunk

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)


def layout(specs: Iterable[tuple[str, Any, tuple[int, ...]]], *, align: int = ALIGN
           ) -> tuple[tuple[TensorEntry, ...], int]:
    """Index and total size for `(name, dtype, shape)` specs placed in order, `align`-aligned."""
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"flat.layout: align must be an int >= 1, got {align!r}")
    entries, offset, seen = [], 0, set()
    for name, dtype, shape in specs:
        if name in seen:
            raise ValueError(f"flat.layout: tensor name {name!r} appears twice")
        seen.add(name)
        offset = -(-offset // align) * align
        entry = TensorEntry(name, hf.np_dtype(dtype).name, tuple(int(d) for d in shape), offset)
        entries.append(entry)
        offset += entry.nbytes
    return tuple(entries), offset


def _views(buffer: np.ndarray, index: tuple[TensorEntry, ...]) -> dict[str, np.ndarray]:
    out = {}
    for e in index:
        if e.offset < 0 or e.offset + e.nbytes > buffer.size:
            raise ValueError(f"flat index: tensor {e.name!r} at [{e.offset}, {e.offset + e.nbytes}) "
                             f"lies outside the buffer of {buffer.size} bytes")
        out[e.name] = buffer[e.offset:e.offset + e.nbytes].view(hf.np_dtype(e.dtype)).reshape(e.shape)
    return out


def _zero_padding(buffer: np.ndarray, index: tuple[TensorEntry, ...]) -> None:
    end = 0
    for e in index:
        buffer[end:e.offset] = 0
        end = e.offset + e.nbytes
    buffer[end:] = 0


def _check_buffer(buffer: Any, what: str) -> np.ndarray:
    buffer = np.asarray(buffer)
    if buffer.dtype != np.uint8 or buffer.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D uint8 buffer, got {buffer.dtype} of shape {buffer.shape}")
    return buffer


def flatten(tensors: Mapping[str, Any], *, align: int = ALIGN) -> tuple[np.ndarray, tuple[TensorEntry, ...]]:
    """One uint8 buffer holding `tensors` (in mapping order, each C-contiguous) and its index."""
    arrays = {name: np.asarray(t) for name, t in tensors.items()}
    index, total = layout(((n, a.dtype, a.shape) for n, a in arrays.items()), align=align)
    buffer = np.empty(total, np.uint8)
    _zero_padding(buffer, index)
    for name, view in _views(buffer, index).items():
        np.copyto(view, arrays[name], casting="no")
    return buffer, index


def unflatten(buffer: Any, index: tuple[TensorEntry, ...]) -> dict[str, np.ndarray]:
    """Name -> zero-copy view into `buffer` (read-only if the buffer is)."""
    return _views(_check_buffer(buffer, "flat.unflatten"), index)


def _leaf(tree: Mapping, path: tuple[str, ...]) -> np.ndarray:
    node = tree
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            raise KeyError(f"flat.params_to_flat: params tree has no entry {'/'.join(path)!r}")
        node = node[key]
    return np.asarray(node)


TILE = 64  # elements per side of a transposing copy's tile (fits L1 for any dtype here)


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src (cast as needed). A transposed 2-D source is copied in tiles: numpy's
    element-by-element strided walk misses the cache on every read (~2x slower here)."""
    if src.ndim != 2 or src.flags.c_contiguous or min(src.shape) <= TILE:
        np.copyto(dst, src, casting="unsafe")
        return
    rows, cols = src.shape
    for i in range(0, rows, TILE):
        for j in range(0, cols, TILE):
            np.copyto(dst[i:i + TILE, j:j + TILE], src[i:i + TILE, j:j + TILE], casting="unsafe")


def params_to_flat(cfg: DecoderConfig, params: Any, *, dtype: Any = None, align: int = ALIGN,
                   workers: int = 1, allocate: Callable[[int], np.ndarray] | None = None
                   ) -> tuple[np.ndarray, tuple[TensorEntry, ...]]:
    """Engine-layout flat buffer of a params tree: `flatten(hf.params_to_hf(cfg, params, dtype))`.

    Written in one pass per tensor (transpose and cast straight into the buffer, no intermediate
    HF dict), which matters on the master relay for GB-sized models; `workers` threads convert
    tensors in parallel (numpy copies release the GIL). `dtype=None` keeps each leaf's dtype
    (the publisher already stored the rollout dtype). `allocate(n)` gives the uint8 buffer of
    n bytes to write into (default: a new numpy array).
    """
    tree = params.to_pure_dict() if hasattr(params, "to_pure_dict") else params
    entries = hf.name_map(cfg)
    leaves = {e.path: _leaf(tree, e.path) for e in entries}
    specs = [(e.hf_name, leaves[e.path].dtype if dtype is None else dtype, e.hf_shape)
             for e in entries]
    index, total = layout(specs, align=align)
    buffer = np.empty(total, np.uint8) if allocate is None else allocate(total)
    if buffer.dtype != np.uint8 or buffer.shape != (total,):
        raise ValueError(f"flat.params_to_flat: allocate({total}) gave {buffer.dtype} "
                         f"{buffer.shape}, expected uint8 ({total},)")
    _zero_padding(buffer, index)
    views = _views(buffer, index)

    def convert(e: hf.Entry) -> None:
        leaf = leaves[e.path]
        try:
            value = e.to_hf(leaf[e.layer] if e.layer is not None else leaf)
        except (ValueError, IndexError) as err:
            raise ValueError(f"flat.params_to_flat: params {'/'.join(e.path)} of shape "
                             f"{leaf.shape} cannot give {e.hf_name!r} of shape {e.hf_shape}: "
                             f"{err}") from None
        if value.shape != e.hf_shape:
            raise ValueError(f"flat.params_to_flat: params {'/'.join(e.path)} gives {e.hf_name!r} "
                             f"of shape {value.shape}, expected {e.hf_shape}")
        _copy(views[e.hf_name], value)

    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(convert, entries))
    else:
        for e in entries:
            convert(e)
    return buffer, index


def flat_to_params(cfg: DecoderConfig, buffer: Any, index: tuple[TensorEntry, ...], *,
                   dtype: Any = None) -> dict:
    """Params pure dict from an engine-layout buffer (`hf.hf_to_params` of its views)."""
    return hf.hf_to_params(cfg, unflatten(buffer, index), source="flat weight buffer", dtype=dtype)


def checksum(data: Any) -> int:
    """crc32 of a byte buffer (zlib's polynomial; computed by the `isal` package when it is
    installed, else by zlib at ~3.5 GB/s on one core here)."""
    return _crc32(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


def make_manifest(version: int, buffer: Any, index: tuple[TensorEntry, ...], num_chunks: int
                  ) -> Manifest:
    """Cuts `buffer` into `num_chunks` chunks (`chain.chunk_bounds`) and checksums each."""
    buffer = _check_buffer(buffer, "flat.make_manifest")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"flat.make_manifest: version must be an int >= 0, got {version!r}")
    end = max((e.offset + e.nbytes for e in index), default=0)
    if end > buffer.size:
        raise ValueError(f"flat.make_manifest: index ends at byte {end}, buffer has {buffer.size}")
    bounds = chunk_bounds(buffer.size, num_chunks)
    sums = tuple(checksum(buffer[s:e]) for s, e in bounds)
    return Manifest(version, tuple(index), int(buffer.size), bounds, sums)


def check_chunk(manifest: Manifest, chunk: int, data: Any) -> str | None:
    """Why chunk `chunk` of `manifest` must be rejected, or None when it is intact."""
    if not 0 <= chunk < manifest.num_chunks:
        return f"chunk {chunk} out of range for {manifest.num_chunks} chunks"
    start, end = manifest.chunks[chunk]
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 1:
        return f"chunk {chunk}: expected 1-D uint8 bytes, got {data.dtype} of shape {data.shape}"
    if data.size != end - start:
        return f"chunk {chunk}: truncated or padded, {data.size} bytes instead of {end - start}"
    got = checksum(data)
    if got != manifest.checksums[chunk]:
        return f"chunk {chunk}: crc32 {got:#010x} does not match {manifest.checksums[chunk]:#010x}"
    return None
