"""Checked conversions of per-token arrays, shared by the data records and the engine protocol.

No jax import: rollout workers with a vLLM engine use these records too.
"""
from __future__ import annotations

import numpy as np


def int_ids(values, what: str) -> np.ndarray:
    """`values` as a 1-D int64 array (token ids, versions); `what` names it in the error."""
    arr = np.asarray(values if len(values) else np.zeros((0,), np.int64))
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(f"{what}: expected a 1-D sequence of ints, got dtype {arr.dtype} shape {arr.shape}")
    return arr.astype(np.int64)


def per_token_floats(values, what: str, length: int, unit: str = "token") -> np.ndarray:
    """`values` as a float32 array of exactly `length` entries (one per `unit`)."""
    arr = np.asarray(values, dtype=np.float32).reshape(-1)
    if arr.shape[0] != length:
        raise ValueError(f"{what}: expected {length} values (one per {unit}), got {arr.shape[0]}")
    return arr
