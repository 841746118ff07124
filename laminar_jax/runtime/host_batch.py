"""A learner host's part of the global batch (learner.hosts > 1): the agreements it needs.

The data actor hands each host only its groups (`DataActor.wait_sample_hosts` / `host_part`:
host p gets the p-th contiguous slice of the sampled groups). Each host assembles and lays out
its own rows, and `distributed.global_arrays` glues the hosts' rows into the step's global
arrays. Every compiled program must see the same shapes on every host, and a few numbers are of
the whole batch; these small collectives settle them (every host calls them in the same order):

    plan(groups)            one row length for all hosts (the longest trajectory anywhere), the
                            host's group-id offset, the batch's group count
    advantages(...)         per-group (and batch-whitened) advantages need every host's rewards
                            and masks: gathered (a few floats a row), computed alike on every
                            host, each keeps its rows
    layout(...)             packed row counts: the largest host's, so the shapes agree
    any_host(flags)         e.g. which past versions' log-probs any host needs

One host (the default): each is the single-process computation, no collective.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from laminar_jax.runtime import batch as B


class Plan(NamedTuple):
    length: int | None    # the agreed row length (None: one host, the batch's own bucket)
    offset: int           # this host's first group id in the global batch
    total_groups: int     # groups of the global batch (after rejections)


def _allgather(x: np.ndarray) -> np.ndarray:
    # imported here: the driver loads this module (through the learner actor's class) and must
    # not import jax (tests/laminar_jax/runtime/test_startup.py)
    from laminar_jax.learner import distributed as dist
    return dist.allgather(x)


def _hosts() -> tuple[int, int]:
    import jax
    return jax.process_count(), jax.process_index()


def plan(groups: Sequence[Sequence[Any]], *, max_seq_len: int, min_len: int) -> Plan:
    """ValueError on every host when no host has a trajectory left."""
    hosts, me = _hosts()
    longest = max((t.prompt_tokens.shape[0] + t.num_tokens for g in groups for t in g), default=0)
    if hosts == 1:
        if not groups:
            raise ValueError(f"learner.max_seq_len={max_seq_len}: every trajectory of the batch is longer")
        return Plan(None, 0, len(groups))
    every = _allgather(np.asarray([len(groups), longest], np.int64))   # [hosts, 2]
    total = int(every[:, 0].sum())
    if total == 0:
        raise ValueError(f"learner.max_seq_len={max_seq_len}: every trajectory of the batch (all "
                         f"{hosts} learner hosts) is longer")
    length = B.bucket_len(int(every[:, 1].max()), max_len=max_seq_len, min_len=min_len)
    return Plan(length, int(every[:me, 0].sum()), total)


ADV_KEYS = ("rewards", "group_ids", "valid", "response_mask")


def advantages(adv_fn: Any, batch: dict, p: Plan) -> tuple[np.ndarray, dict]:
    """`adv_fn(batch, num_groups)` over the global batch; this host's rows of it."""
    hosts, me = _hosts()
    if hosts == 1:
        return adv_fn(batch, p.total_groups)
    mine = {k: batch[k] for k in ADV_KEYS}
    mine["group_ids"] = np.minimum(mine["group_ids"] + p.offset, p.total_groups - 1).astype(np.int32)
    full = {k: _rows(_allgather(v)) for k, v in mine.items()}   # host-major rows
    adv, metrics = adv_fn(full, p.total_groups)
    n = batch["rewards"].shape[0]
    return adv[me * n:(me + 1) * n], metrics


def _rows(stacked: np.ndarray) -> np.ndarray:
    return stacked.reshape((-1,) + stacked.shape[2:])


def layout(batch: dict, mini_batches: int, *, pack_rows: bool, max_seq_len: int, row_multiple: int) -> list[dict]:
    """`batch.layout` of this host's rows. Packed with several hosts: each host packs to a
    multiple of row_multiple / hosts (the hosts' rows then add up to the one-host row buckets)
    and takes the largest host's row count, so every host's mini-batch has the same shape."""
    hosts, _ = _hosts()
    if hosts == 1 or not pack_rows:
        return B.layout(batch, mini_batches, pack_rows=pack_rows, max_seq_len=max_seq_len,
                        row_multiple=row_multiple)
    if row_multiple % hosts:
        raise ValueError(f"packed rows: the row multiple {row_multiple} does not split over {hosts} learner hosts")
    local = row_multiple // hosts
    parts = B.split(batch, mini_batches)
    mbs = [B.pack(mb, max_seq_len=max_seq_len, row_multiple=local) for mb in parts]
    want = _allgather(np.asarray([mb["tokens"].shape[0] for mb in mbs], np.int64)).max(axis=0)
    return [mb if mb["tokens"].shape[0] == w else B.pack(part, max_seq_len=max_seq_len, row_multiple=local,
                                                         min_rows=int(w))
            for mb, part, w in zip(mbs, parts, want)]


def any_host(flags: Sequence[bool]) -> list[bool]:
    hosts, _ = _hosts()
    if hosts == 1 or not flags:
        return [bool(f) for f in flags]
    return [bool(x) for x in _allgather(np.asarray(flags, np.int32)).any(axis=0)]


def local_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """This host's `rows` rows of a step output that is either its own rows or the whole
    (replicated) batch's."""
    hosts, me = _hosts()
    x = np.asarray(x)
    if x.shape[0] == rows or hosts == 1:
        return x
    if x.shape[0] != rows * hosts:
        raise ValueError(f"a step output of {x.shape[0]} rows is neither this host's {rows} nor all {hosts} hosts'")
    return x[me * rows:(me + 1) * rows]
