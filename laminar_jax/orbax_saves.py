"""One orbax save at a time per process: every orbax save of a process takes this slot first.

orbax (0.12) numbers each save from a process-wide counter (`OperationIdGenerator`: class state,
bumped by `Checkpointer.save`), and its background commit threads look their signalling keys up
by the counter's *current* value ("awaitable_signals_contract_<id>/step_directory_creation").
A second save started in another thread before the first one has committed moves the counter
under it, and the first commit then waits for a key nobody sets (CI saw the learner's checkpoint
hang 300 s while the publisher's writer thread saved a version). So a save holds the slot from
before `save()` until orbax has committed it (`wait_until_finished`), whichever thread that ends
in: the publisher's writer thread saves and waits in one thread; the learner's checkpointer saves
in the learner thread and a commit thread waits and releases.

Restores take no slot: they neither bump the counter nor use the signalling contract.
"""
from __future__ import annotations

import threading
import time

__all__ = ["SaveSlot", "acquire", "holder", "SAVE_SLOT_TIMEOUT_S"]

# A save's commit is bounded by orbax's own timeout (300 s by default); one wait for the slot
# gets a bit more, so an orbax timeout surfaces first, with its own message.
SAVE_SLOT_TIMEOUT_S = 360.0

_slot = threading.Semaphore(1)   # a Semaphore, not a Lock: the releasing thread may differ
_state_lock = threading.Lock()
_holder: tuple[str, float] | None = None   # (what, monotonic time it took the slot)


class SaveSlot:
    """The process's save slot, held by one save until `release()` (once; later calls no-op)."""

    def __init__(self, what: str):
        self.what = what
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        global _holder
        with self._lock:
            if self._released:
                return
            self._released = True
        with _state_lock:
            _holder = None
        _slot.release()

    @property
    def released(self) -> bool:
        return self._released

    def __enter__(self) -> "SaveSlot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(what: str, timeout_s: float = SAVE_SLOT_TIMEOUT_S) -> SaveSlot:
    """Waits for the process's save slot (held by at most one orbax save, until its commit).

    Args:
      what: the save about to start, for error messages ("publish v12", "checkpoint 40").
      timeout_s: TimeoutError naming the save holding the slot once this passes.
    """
    global _holder
    if not _slot.acquire(timeout=timeout_s):
        held = holder()
        by = "nobody (released meanwhile)" if held is None else f"{held[0]!r} for {held[1]:.0f} s"
        raise TimeoutError(f"orbax_saves: {what!r} waited {timeout_s:.0f} s for the process's "
                           f"save slot, held by {by}")
    with _state_lock:
        _holder = (what, time.monotonic())
    return SaveSlot(what)


def holder() -> tuple[str, float] | None:
    """(what, seconds held) of the save holding the slot now, or None."""
    with _state_lock:
        if _holder is None:
            return None
        return _holder[0], time.monotonic() - _holder[1]
