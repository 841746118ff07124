"""Relay chain plan and pipelined broadcast time model (Laminar, arXiv 2510.12633, §4, App. D).

The master relay receives a new weight version from the learner, cuts it into k chunks and
sends them down a chain of relays; every hop forwards chunk i while it receives chunk i+1
[P §4.2, Fig 6]. With p nodes in the chain (master included), M model bytes, per-byte time
T_byte = 1 / bandwidth and per-message startup T_start [P App. D]:

    t_chunk = (M / k) * T_byte + T_start
    T(p, k) = (p + k - 2) * t_chunk
            = M*T_byte + (p-2)*T_start + k*T_start + (p-2)*M*T_byte / k
    k*      = sqrt((p-2) * M * T_byte / T_start)
    T*(p)   = M*T_byte + (p-2)*T_start + 2*sqrt((p-2) * M * T_byte * T_start)

The chain is a tuple of node ids, master first. When a relay fails it is cut out and its two
neighbours are linked to each other; no other link changes [P §4.3, Fig 7]. When the master
fails, the next node in the chain becomes master (rule chosen here; the paper says only that
the manager "picks a new master from the live relays").

Pure python (no jax, Ray, I/O or clock): the rollout manager, the relay runtime and the cluster
simulator call the same functions.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Hashable, Iterable, Sequence

__all__ = [
    "Transfer",
    "chain_order",
    "relink",
    "links",
    "chunk_time",
    "broadcast_time",
    "arrival_time",
    "optimal_chunks",
    "chunk_schedule",
    "chunk_bounds",
]


# ---------------------------------------------------------------------------------------------
# Chain topology


def chain_order(nodes: Iterable[Hashable], master: Hashable) -> tuple:
    """The broadcast chain: `master` first, then the other nodes in the order given.

    The caller decides the order of the rest (e.g. by network locality); it is kept as is, so
    the chain is deterministic. Node ids must be unique and `master` must be one of them.
    """
    nodes = tuple(nodes)
    if len(set(nodes)) != len(nodes):
        dup = sorted({repr(n) for n in nodes if nodes.count(n) > 1})
        raise ValueError(f"chain.chain_order: node ids must be unique, repeated: {', '.join(dup)}")
    if master not in nodes:
        raise ValueError(
            f"chain.chain_order: master {master!r} is not among the nodes {list(nodes)!r}"
        )
    return (master,) + tuple(n for n in nodes if n != master)


def relink(order: Sequence[Hashable], removed: Hashable) -> tuple:
    """The chain after node `removed` leaves it [P §4.3, Fig 7].

    Its upstream and downstream neighbours are linked to each other; every other link is kept.
    If `removed` is the master (position 0), the next node in the chain becomes the new master
    (the rest keep their order). Removing the only node gives the empty chain.
    """
    order = tuple(order)
    try:
        pos = order.index(removed)
    except ValueError:
        raise ValueError(
            f"chain.relink: node {removed!r} is not in the chain {list(order)!r}"
        ) from None
    return order[:pos] + order[pos + 1 :]


def links(order: Sequence[Hashable]) -> dict:
    """Each node's (upstream, downstream) neighbour in the chain; None at the two ends.

    The master's upstream is None (it is fed by the learner); the tail's downstream is None.
    """
    order = tuple(order)
    last = len(order) - 1
    return {
        node: (order[i - 1] if i > 0 else None, order[i + 1] if i < last else None)
        for i, node in enumerate(order)
    }


# ---------------------------------------------------------------------------------------------
# Time model [P App. D]


def _check_int(where, name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"chain.{where}: {name} must be an int >= {minimum}, got {value!r}")


def _check_nonneg(where, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
        math.isfinite(value) and value >= 0
    ):
        raise ValueError(f"chain.{where}: {name} must be a finite number >= 0, got {value!r}")


def _check_model(where, model_bytes, t_byte, t_start):
    _check_nonneg(where, "model_bytes", model_bytes)
    _check_nonneg(where, "t_byte", t_byte)
    _check_nonneg(where, "t_start", t_start)


def chunk_time(k: int, model_bytes: float, t_byte: float, t_start: float) -> float:
    """Time of one pipeline step, one chunk over one hop: t_chunk = (M/k)*T_byte + T_start."""
    _check_int("chunk_time", "k", k, 1)
    _check_model("chunk_time", model_bytes, t_byte, t_start)
    return model_bytes / k * t_byte + t_start


def broadcast_time(p: int, k: int, model_bytes: float, t_byte: float, t_start: float) -> float:
    """Time until the last of p chain nodes holds all k chunks [P App. D].

    T(p, k) = (p + k - 2) * ((M/k)*T_byte + T_start) for p >= 2. A chain of one node (the
    master alone) has nothing to send: T(1, k) = 0.
    """
    _check_int("broadcast_time", "p", p, 1)
    if p == 1:
        _check_int("broadcast_time", "k", k, 1)
        _check_model("broadcast_time", model_bytes, t_byte, t_start)
        return 0.0
    return (p + k - 2) * chunk_time(k, model_bytes, t_byte, t_start)


def arrival_time(position: int, k: int, model_bytes: float, t_byte: float, t_start: float) -> float:
    """Time at which the node at chain `position` (0 = master) holds all k chunks.

    The node at position j >= 1 receives chunk c (0-based) in pipeline step c + j - 1, so it
    is complete after (j + k - 1) * t_chunk; the master holds the weights at time 0. For the
    tail, j = p - 1, this is `broadcast_time(p, k, ...)`.
    """
    _check_int("arrival_time", "position", position, 0)
    t_chunk = chunk_time(k, model_bytes, t_byte, t_start)
    if position == 0:
        return 0.0
    return (position + k - 1) * t_chunk


def optimal_chunks(
    p: int,
    model_bytes: float,
    t_byte: float,
    t_start: float,
    *,
    max_chunks: int | None = None,
) -> int:
    """The chunk count k >= 1 that minimises T(p, k) [P App. D].

    T(p, k) = const + k*T_start + (p-2)*M*T_byte / k is convex in k with real minimiser
    k* = sqrt((p-2)*M*T_byte / T_start), so the best integer is floor(k*) or ceil(k*), each
    clipped to [1, cap]; the smaller T wins, and on a tie the smaller k (fewer messages).
    cap = min(max_chunks, floor(M)) keeps every chunk at least one byte; with T_start = 0 and
    p > 2, more chunks always help and the answer is the cap. For p <= 2 the answer is 1.
    """
    _check_int("optimal_chunks", "p", p, 1)
    _check_model("optimal_chunks", model_bytes, t_byte, t_start)
    if max_chunks is not None:
        _check_int("optimal_chunks", "max_chunks", max_chunks, 1)
    cap = max(1, math.floor(model_bytes))
    if max_chunks is not None:
        cap = min(cap, max_chunks)
    pipeline = (p - 2) * model_bytes * t_byte
    if p <= 2 or pipeline == 0.0:
        return 1
    if t_start == 0.0:
        return cap
    k_star = math.sqrt(pipeline / t_start)
    lo = min(max(1, math.floor(k_star)), cap)
    hi = min(max(1, math.ceil(k_star)), cap)
    if lo == hi:
        return lo
    # T(hi) < T(lo) <=> hi*T_start + C/hi < lo*T_start + C/lo <=> lo*hi*T_start < C, with
    # C = (p-2)*M*T_byte: compared this way an exact tie (lo*hi = k*^2) is seen as one.
    return hi if lo * hi * t_start < pipeline else lo


# ---------------------------------------------------------------------------------------------
# Pipeline schedule for the relay runtime and the simulator


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    """In one pipeline step, the node at chain position `sender` sends `chunk` to `receiver`."""

    sender: int
    receiver: int
    chunk: int


def chunk_schedule(p: int, k: int) -> tuple[tuple[Transfer, ...], ...]:
    """Which chunk each hop carries in each pipeline step (positions are chain indices).

    In step s (0-based) the hop from position h to h+1 carries chunk s - h, when
    0 <= s - h < k. Every node sends and receives at most one chunk per step, forwards a
    chunk only in a step after it received it, and the schedule has p + k - 2 steps, each
    lasting t_chunk: the length T(p, k) of `broadcast_time`. Empty for p = 1.
    Holds O(p*k) records, meant for small chains and the relay runtime's own hop; timing
    questions on big chains go to `arrival_time` / `broadcast_time`.
    """
    _check_int("chunk_schedule", "p", p, 1)
    _check_int("chunk_schedule", "k", k, 1)
    if p == 1:
        return ()
    hops = p - 1
    return tuple(
        tuple(
            Transfer(sender=h, receiver=h + 1, chunk=s - h)
            for h in range(max(0, s - k + 1), min(hops, s + 1))
        )
        for s in range(p + k - 2)
    )


def chunk_bounds(model_bytes: int, k: int) -> tuple[tuple[int, int], ...]:
    """Byte ranges [start, end) of k contiguous, near-equal chunks of a `model_bytes` buffer.

    The first model_bytes % k chunks are one byte longer, so sizes differ by at most one
    byte. k may not exceed model_bytes (no empty chunks), except k = 1 for an empty buffer.
    """
    _check_int("chunk_bounds", "model_bytes", model_bytes, 0)
    _check_int("chunk_bounds", "k", k, 1)
    if k > max(model_bytes, 1):
        raise ValueError(
            f"chain.chunk_bounds: k={k} chunks would leave some empty for model_bytes={model_bytes}"
        )
    base, extra = divmod(model_bytes, k)
    bounds = []
    start = 0
    for c in range(k):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return tuple(bounds)
