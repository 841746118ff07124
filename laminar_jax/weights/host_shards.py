"""Per-host publish of a multi-host learner: every host writes its own shards and a manifest; the
master relay assembles the engine layout from them (no gather to host 0).

One version in the weight store:

    v{version:010d}.hosts-tmp/   while the hosts write, each only its own two files:
        host{p:04d}.bin          host p's shards, back to back
        host{p:04d}.json         written last (rename): {"format", "version", "host", "hosts",
                                 "tensors": [{"name": [key, ...], "shape", "dtype",
                                 "index": [[start, stop], ...], "offset", "nbytes", "crc32"}]}
    v{version:010d}/             host 0 renames the folder once every host's manifest is in

Each distinct shard of a tensor is written by exactly one of the hosts holding it (in turn, so a
replicated tensor's bytes spread over the hosts), so the hosts' pieces tile every tensor once. `assemble`
reads the manifests, checks that every host's is there and agrees on the host count, checks each
piece's length and crc32 and that the pieces cover each tensor, and returns the host numpy tree
(the same tree `publish._restore_numpy` gives for an orbax checkpoint). Any failure is a
`ShardError` naming the host and the tensor; the relay then serves nothing of that version.

`HostShardWriter` has the calls `publish.Publisher` makes of an orbax `AsyncCheckpointer`
(`save`, `wait_until_finished`, `cancel`, `close`): `save` copies this host's shards to host
memory and returns, a thread writes them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import zlib
from typing import Any, Sequence

import numpy as np

__all__ = ["Piece", "ShardError", "HostShardWriter", "host_pieces", "write_host", "assemble",
           "is_host_sharded", "staging_path", "manifest_path", "data_path"]

FORMAT = "laminar-host-shards-1"
STAGING_SUFFIX = ".hosts-tmp"
HOSTS_WAIT_S = 120.0   # host 0 waits this long for the other hosts' manifests
_POLL_S = 0.02


class ShardError(RuntimeError):
    """A version's per-host shards are missing or torn; names the host (and tensor)."""

    def __init__(self, message: str, *, host: int | None = None, tensor: str | None = None):
        super().__init__(message)
        self.host, self.tensor = host, tensor


@dataclasses.dataclass(frozen=True)
class Piece:
    """One shard of one tensor as a host holds it: `index` is its [start, stop) per dimension."""

    name: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    index: tuple[tuple[int, int], ...]
    data: np.ndarray


def staging_path(final: str) -> str:
    return final.rstrip("/") + STAGING_SUFFIX


def manifest_path(folder: str, host: int) -> str:
    return os.path.join(folder, f"host{host:04d}.json")


def data_path(folder: str, host: int) -> str:
    return os.path.join(folder, f"host{host:04d}.bin")


def is_host_sharded(folder: str) -> bool:
    """Whether a version folder holds per-host shards (else it is an orbax checkpoint)."""
    try:
        return any(n.startswith("host") and n.endswith(".json") for n in os.listdir(folder))
    except OSError:
        return False


def _name(path: Any) -> tuple[str, ...]:
    out = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        if key is None:
            raise ValueError(f"host_shards: cannot name the tree path {path!r}")
        out.append(str(key))
    return tuple(out)


def _index(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((sl.start or 0, n if sl.stop is None else sl.stop) for sl, n in zip(index, shape))


def host_pieces(tree: Any) -> list[Piece]:
    """This process's pieces of a tree of (global) jax arrays, copied to host memory. Each
    distinct shard of a tensor is written by one of the processes that hold it, taken in turn
    (the k-th distinct shard of the tree by the (k mod n)-th of its n holders), so replicated
    tensors spread their bytes over the hosts; every process derives the same choice from the
    shardings alone. Plain numpy leaves are process 0's alone."""
    import jax

    me, pieces, k = jax.process_index(), [], 0
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = _name(path)
        if not isinstance(x, jax.Array):
            if me == 0:
                x = np.asarray(x)
                pieces.append(Piece(name, x.shape, x.dtype.name, tuple((0, n) for n in x.shape), x))
            continue
        shape = tuple(int(n) for n in x.shape)
        holders: dict[tuple, set] = {}
        for device, index in x.sharding.devices_indices_map(shape).items():
            holders.setdefault(_index(index, shape), set()).add(device.process_index)
        local = {}
        for s in x.addressable_shards:
            local.setdefault(_index(s.index, shape), s)
        for key in sorted(holders):
            procs = sorted(holders[key])
            owner = procs[k % len(procs)]
            k += 1
            if owner == me:
                pieces.append(Piece(name, shape, np.dtype(x.dtype).name, key, np.asarray(local[key].data)))
    return pieces


def write_host(folder: str, *, version: int, host: int, hosts: int, pieces: Sequence[Piece],
               cancelled: threading.Event | None = None) -> bool:
    """Writes host `host`'s data file, then its manifest (renamed into place: a manifest present
    means its data is complete). False when `cancelled` was set (nothing is left behind)."""
    os.makedirs(folder, exist_ok=True)
    entries, offset = [], 0
    data, manifest = data_path(folder, host), manifest_path(folder, host)
    with open(data, "wb") as f:
        for p in pieces:
            if cancelled is not None and cancelled.is_set():
                break
            # bytes as uint8 (a memoryview cannot take bfloat16)
            raw = np.ascontiguousarray(p.data).reshape(-1).view(np.uint8)
            f.write(raw)
            entries.append({"name": list(p.name), "shape": list(p.shape), "dtype": p.dtype,
                            "index": [list(i) for i in p.index], "offset": offset, "nbytes": raw.nbytes,
                            "crc32": zlib.crc32(raw)})
            offset += raw.nbytes
    if cancelled is not None and cancelled.is_set():
        for path in (data, manifest):
            if os.path.exists(path):
                os.remove(path)
        return False
    tmp = manifest + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "version": version, "host": host, "hosts": hosts, "tensors": entries}, f)
    os.replace(tmp, manifest)
    return True


def missing_hosts(folder: str, hosts: int) -> list[int]:
    return [h for h in range(hosts) if not os.path.exists(manifest_path(folder, h))]


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:   # bfloat16 and the float8 types live in ml_dtypes
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))


def _read_manifest(folder: str, host: int) -> dict:
    path = manifest_path(folder, host)
    try:
        with open(path) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise ShardError(f"{folder}: learner host {host}'s manifest {os.path.basename(path)} is missing; "
                         f"the version is not complete", host=host) from None
    except (OSError, ValueError) as e:
        raise ShardError(f"{path}: learner host {host}'s manifest cannot be read: {e}", host=host) from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("host") != host:
        raise ShardError(f"{path}: not a {FORMAT} manifest of host {host}", host=host)
    return m


def assemble(folder: str) -> dict:
    """The host numpy tree of a per-host version folder, every piece checked; ShardError naming
    the host (and tensor) when a manifest is missing, a piece is short or its crc32 differs, or
    the pieces leave part of a tensor uncovered."""
    first = next((h for h in range(1 << 16) if os.path.exists(manifest_path(folder, h))), None)
    if first is None:
        raise ShardError(f"{folder}: no learner host's manifest; the version is not complete")
    hosts = int(_read_manifest(folder, first)["hosts"])
    manifests = [_read_manifest(folder, h) for h in range(hosts)]   # a missing one: ShardError naming it
    for m in manifests:
        if m["hosts"] != hosts or m["version"] != manifests[0]["version"]:
            raise ShardError(f"{folder}: host {m['host']}'s manifest says version {m['version']} of {m['hosts']} "
                             f"hosts, host 0's version {manifests[0]['version']} of {hosts}", host=m["host"])
    arrays: dict[tuple, np.ndarray] = {}
    covered: dict[tuple, int] = {}
    for m in manifests:
        host = m["host"]
        path = data_path(folder, host)
        try:
            blob = np.fromfile(path, np.uint8)
        except OSError as e:
            raise ShardError(f"{path}: learner host {host}'s shards cannot be read: {e}", host=host) from None
        for e in m["tensors"]:
            name, tensor = tuple(e["name"]), "/".join(e["name"])
            s, n = int(e["offset"]), int(e["nbytes"])
            raw = blob[s:s + n]
            if raw.size != n:
                raise ShardError(f"{path}: learner host {host}'s shard of {tensor} is torn: {raw.size} of {n} "
                                 f"bytes", host=host, tensor=tensor)
            if zlib.crc32(raw) != e["crc32"]:
                raise ShardError(f"{path}: learner host {host}'s shard of {tensor} fails its crc32 "
                                 f"({zlib.crc32(raw):#010x}, manifest {e['crc32']:#010x})", host=host, tensor=tensor)
            dtype, shape = _dtype(e["dtype"]), tuple(e["shape"])
            index = tuple(slice(a, b) for a, b in e["index"])
            out = arrays.get(name)
            if out is None:
                out = arrays[name] = np.empty(shape, dtype)
                covered[name] = 0
            if out.shape != shape or out.dtype != dtype:
                raise ShardError(f"{path}: host {host} says {tensor} is {dtype}{list(shape)}, another host "
                                 f"{out.dtype}{list(out.shape)}", host=host, tensor=tensor)
            piece_shape = tuple(b - a for a, b in e["index"])
            out[index] = raw.view(dtype).reshape(piece_shape)
            covered[name] += int(np.prod(piece_shape, dtype=np.int64))
    for name, out in arrays.items():
        if covered[name] != out.size:   # replica 0 pieces tile a tensor exactly once
            raise ShardError(f"{folder}: the hosts' pieces of {'/'.join(name)} cover {covered[name]} of its "
                             f"{out.size} elements", tensor="/".join(name))
    tree: dict = {}
    for name, out in arrays.items():
        node = tree
        for k in name[:-1]:
            node = node.setdefault(k, {})
        node[name[-1]] = out
    return tree


class HostShardWriter:
    """Per-host writes of versions, driven as `publish.Publisher` drives an orbax checkpointer.

    `save(path, args)` takes `args.item` (the cast params), copies this host's pieces to host
    memory and starts a thread that writes them into `staging_path(path)`; host 0's thread then
    waits (up to `hosts_wait_s`) for every host's manifest and renames the folder to `path`, so
    a finalized version folder always holds every host's shards. The other hosts' threads end once
    that rename is seen. `wait_until_finished` raises the thread's error (a host that never
    wrote: a ShardError naming it)."""

    def __init__(self, *, host: int | None = None, hosts: int | None = None, hosts_wait_s: float = HOSTS_WAIT_S):
        if host is None or hosts is None:
            import jax
            host, hosts = jax.process_index(), jax.process_count()
        self.host, self.hosts, self.hosts_wait_s = host, hosts, hosts_wait_s
        self._cancelled = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.timings: dict[str, float] = {}

    def save(self, path: str, args: Any) -> None:
        """Starts writing one version (the Publisher reuses a writer once its last write ended)."""
        if self._thread is not None:
            self._thread.join()
        self._error = None
        t0 = time.perf_counter()
        pieces = host_pieces(args.item)   # the device-to-host copy: the only blocking part
        self.timings = {"copy_s": time.perf_counter() - t0}
        version = int(os.path.basename(path.rstrip("/"))[1:])
        self._thread = threading.Thread(target=self._run, args=(path, version, pieces),
                                        name=f"host-shards-v{version}", daemon=True)
        self._thread.start()

    def _run(self, path: str, version: int, pieces: list[Piece]) -> None:
        try:
            t0 = time.perf_counter()
            staging = staging_path(path)
            if not write_host(staging, version=version, host=self.host, hosts=self.hosts, pieces=pieces,
                              cancelled=self._cancelled):
                return
            self.timings["write_s"] = time.perf_counter() - t0
            deadline = time.monotonic() + self.hosts_wait_s
            if self.host != 0:   # done when host 0 has renamed the folder (every host's files are in)
                while not os.path.isdir(path) and os.path.isdir(staging):   # gone: renamed or given up
                    if self._cancelled.is_set():
                        return
                    if time.monotonic() > deadline:
                        raise ShardError(f"{staging}: learner host 0 did not complete version {version} "
                                         f"within {self.hosts_wait_s:.0f} s", host=0)
                    time.sleep(_POLL_S)
                return
            while missing := missing_hosts(staging, self.hosts):
                if self._cancelled.is_set():
                    return
                if time.monotonic() > deadline:
                    raise ShardError(f"{staging}: learner hosts {missing} wrote no manifest within "
                                     f"{self.hosts_wait_s:.0f} s; version {version} is not complete",
                                     host=missing[0])
                time.sleep(_POLL_S)
            os.replace(staging, path)
            self.timings["complete_s"] = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - raised by wait_until_finished
            self._error = e

    def wait_until_finished(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and not self._cancelled.is_set():
            raise self._error

    def cancel(self) -> None:
        self._cancelled.set()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
