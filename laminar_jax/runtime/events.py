"""Rate-limited run events: a fault that repeats per group (every prompt too long, a relay that
keeps failing) must not flood events.jsonl (issue: 38k events in 150 s)."""
from __future__ import annotations

import time
from typing import Any, Callable

EVENT_WINDOW_S = 10.0   # per kind, at most EVENT_BURST events per window are written
EVENT_BURST = 50


class EventLimiter:
    """Writes at most `burst` events of one kind from one source (rollout or relay) per
    `window_s`; the rest are counted and written as one "events_suppressed" record (event,
    source, count) when the window closes."""

    def __init__(self, write: Callable[..., None], *, burst: int = EVENT_BURST,
                 window_s: float = EVENT_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.write, self.burst, self.window_s, self.clock = write, burst, window_s, clock
        self._windows: dict[tuple, list] = {}   # (kind, source) -> [window start, written, suppressed]

    def __call__(self, kind: str, **fields: Any) -> None:
        now = self.clock()
        key = (kind, fields.get("rollout") or fields.get("relay"))
        w = self._windows.get(key)
        if w is None or now - w[0] >= self.window_s:
            if w is not None and w[2]:
                self._suppressed(key, w[2])
            w = self._windows[key] = [now, 0, 0]
        if w[1] < self.burst:
            w[1] += 1
            self.write(kind, **fields)
        else:
            w[2] += 1

    def _suppressed(self, key: tuple, count: int) -> None:
        self.write("events_suppressed", event=key[0], source=key[1], count=count, window_s=self.window_s)

    def flush(self) -> None:
        for key, w in self._windows.items():
            if w[2]:
                self._suppressed(key, w[2])
                w[2] = 0
