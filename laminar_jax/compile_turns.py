"""Processes of one machine that compile the same program take turns, so it is compiled once.

Every JAX rollout of a run compiles the same prefill and decode programs when its first batch
arrives. With a cold compile cache they all compiled them at once: on the 2-core machine two
rollouts spent ~8 CPU s each on identical XLA compiles while the learner waited for cores.
`turn(folder, key)` holds an exclusive file lock named after `key` in `folder` (inside the
persistent compile cache, which every process of the machine shares): the first process
compiles and JAX writes the executable to the cache before the call returns; the others wait,
then trace the same program and load it from the cache. A warm cache holds the turn for the
trace and load only (~0.2 s per program).

The wait is bounded (`wait_s`): past it the process compiles without its turn, as before. A
holder that dies releases its lock with its file descriptor.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from typing import Iterator

WAIT_S = 300.0
_POLL_S = 0.05


@contextlib.contextmanager
def turn(folder: str | None, key: str, *, wait_s: float = WAIT_S) -> Iterator[bool]:
    """Holds the machine-wide turn to compile `key` (any string naming the program and its
    shapes); yields whether it got it (False: `folder` is None, or the wait passed wait_s)."""
    if folder is None:
        yield False
        return
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        deadline, held = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(_POLL_S)
        yield held
    finally:
        os.close(fd)   # releases the lock
