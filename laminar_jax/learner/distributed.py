"""One learner over several processes (hosts): `jax.distributed`, one global mesh, global batches.

Each host runs one learner process; all of them run the *same* jitted programs (JAX is
multi-controller: every process takes part in every compiled step, so they must call them in the
same order with the same shapes). Process ``p`` of ``H`` feeds only its own slice of the global
batch, rows ``[p * R / H, (p + 1) * R / H)``, and ``global_arrays`` glues the slices into global
``jax.Array``s with ``jax.make_array_from_process_local_data``. The global mesh is the usual
``("data", "fsdp", "tensor")`` mesh over ``jax.devices()`` (process-major order), so the batch
axes' leading rows live on process 0's devices, the next on process 1's, and so on.

Waits: ``jax.distributed.initialize`` gets ``initialization_timeout`` (a peer that never comes is a
clear error, not a hang) and a heartbeat timeout (a peer that dies mid-run is also noticed by the
coordination service, which stops the survivors instead of leaving them in a collective).
On CPU the cross-process collectives are gloo's (``jax_cpu_collectives_implementation``).
"""
from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from laminar_jax import sharding as shd

INIT_TIMEOUT_S = 60
# JAX's default: the driver notices a dead host through Ray within a second (runtime.learner_group);
# a short heartbeat would only kill healthy hosts on a loaded machine
HEARTBEAT_TIMEOUT_S = 100


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def coordinator_address(host: str = "127.0.0.1") -> str:
    """``host:port`` for process 0's coordinator; loopback unless a host is given."""
    return f"{host}:{free_port(host)}"


def initialize(coordinator: str, *, num_processes: int, process_id: int,
               timeout_s: float = INIT_TIMEOUT_S, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
    """Joins this process to the ``num_processes``-process JAX cluster (before any JAX computation).

    One process: nothing to join. Raises ``TimeoutError`` naming the coordinator when the others
    do not arrive within ``timeout_s``.
    """
    if num_processes == 1:
        return
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} outside [0, {num_processes})")
    if jax.config.jax_platforms in (None, "", "cpu") or str(jax.config.jax_platforms).startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    host = coordinator.rsplit(":", 1)[0]
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=max(1, int(timeout_s)),
                                   heartbeat_timeout_seconds=max(1, int(heartbeat_timeout_s)),
                                   # process 0 serves the coordinator on the address it was given
                                   coordinator_bind_address=coordinator if process_id == 0 else None)
    except Exception as e:  # XlaRuntimeError: DEADLINE_EXCEEDED / UNAVAILABLE
        raise TimeoutError(f"learner host {process_id}/{num_processes}: jax.distributed.initialize with "
                           f"coordinator {coordinator} failed within {timeout_s:.0f} s "
                           f"(a learner host did not start or cannot reach {host}): {e}") from e
    if jax.process_count() != num_processes:
        raise RuntimeError(f"jax.distributed: {jax.process_count()} processes joined, expected {num_processes}")


def check_mesh(mesh: Any, *, hosts: int, local_devices: int) -> None:
    """Checks that a ``mesh`` config section (data, fsdp, tensor) divides across ``hosts`` hosts of
    ``local_devices`` devices each: it must use every device of every host (each process takes
    part in each step), and a tensor-parallel group must fit in one host, so each host owns whole
    batch shards and a host's slice of the batch is its own rows."""
    data, fsdp, tensor = (getattr(mesh, k, d) for k, d in (("data", -1), ("fsdp", 1), ("tensor", 1)))
    total = hosts * local_devices
    where = f"mesh.data={data} mesh.fsdp={fsdp} mesh.tensor={tensor} with learner.hosts={hosts}"
    if local_devices % tensor:
        raise ValueError(f"{where}: mesh.tensor must divide the {local_devices} devices of one host "
                         f"(a tensor-parallel group may not span hosts)")
    if data == -1:
        if total % (fsdp * tensor):
            raise ValueError(f"{where}: fsdp x tensor = {fsdp * tensor} does not divide the "
                             f"{total} devices of {hosts} hosts x {local_devices}")
        data = total // (fsdp * tensor)
    if data * fsdp * tensor != total:
        raise ValueError(f"{where}: the mesh has {data * fsdp * tensor} devices, but {hosts} hosts x "
                         f"{local_devices} devices = {total}; a multi-host mesh must use every device "
                         f"(set mesh.data=-1)")
    # then data x fsdp = hosts x (local / tensor): every host owns whole batch shards


def global_mesh(mesh_section: Any) -> jax.sharding.Mesh:
    """The ``("data", "fsdp", "tensor")`` mesh over every process's devices (after ``initialize``)."""
    check_mesh(mesh_section, hosts=jax.process_count(), local_devices=jax.local_device_count())
    return shd.mesh_from_config(mesh_section, devices=jax.devices())


def host_slice(rows: int, *, hosts: int, process: int) -> slice:
    """The rows of a global batch of ``rows`` that host ``process`` feeds."""
    if rows % hosts:
        raise ValueError(f"a global batch of {rows} rows does not split across {hosts} learner hosts")
    per = rows // hosts
    return slice(process * per, (process + 1) * per)


def local_part(batch: Any, *, hosts: int | None = None, process: int | None = None) -> Any:
    """This host's rows of a host-side global batch (rank-0 leaves unchanged)."""
    hosts = jax.process_count() if hosts is None else hosts
    process = jax.process_index() if process is None else process
    return jax.tree.map(lambda x: x if np.ndim(x) == 0 else
                        np.asarray(x)[host_slice(np.shape(x)[0], hosts=hosts, process=process)], batch)


def global_arrays(local_batch: Any, mesh: jax.sharding.Mesh, rules: shd.Rules = shd.DEFAULT_RULES) -> Any:
    """Each process's slice of the global batch -> global arrays split over the batch axes.

    Rank >= 1 leaves are this host's rows (global leading dim = local x hosts); rank-0 leaves
    (normalisers) are replicated and must be equal on every host. With one process this is
    ``sharding.shard_batch``."""
    if jax.process_count() == 1:
        return shd.shard_batch(local_batch, mesh, rules)
    div = shd.batch_divisor(mesh, rules) // jax.process_count()

    def put(path, x):
        x = np.asarray(x)
        if x.ndim and x.shape[0] % div:
            raise ValueError(f"batch{jax.tree_util.keystr(path)}: this host's {x.shape[0]} rows do not "
                             f"divide over its {div} batch shards")
        return jax.make_array_from_process_local_data(shd.batch_sharding(mesh, x.ndim, rules), x)
    return jax.tree_util.tree_map_with_path(put, local_batch)


def to_host(tree: Any) -> Any:
    """Numpy copies of a tree of (possibly global) arrays: a replicated array's value, or for an
    array split over processes this process's rows (its addressable shards in index order)."""
    def get(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        shards = sorted(x.addressable_shards, key=lambda s: tuple(i.start or 0 for i in s.index))
        seen, parts = set(), []
        for s in shards:   # replicas (e.g. over "tensor") hold the same rows once
            key = tuple((i.start, i.stop) for i in s.index)
            if key not in seen:
                seen.add(key)
                parts.append(np.asarray(s.data))
        return np.concatenate(parts, axis=0)
    return jax.tree.map(get, tree)


def allgather(x: Any) -> np.ndarray:
    """``[process_count, ...]`` stack of every process's host value ``x`` (a collective: every
    process calls it)."""
    if jax.process_count() == 1:
        return np.asarray(x)[None]
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=False))


def sum_over_hosts(x: Any) -> np.ndarray:
    return allgather(x).sum(axis=0)
