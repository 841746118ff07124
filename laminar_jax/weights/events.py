"""A small event sink for the weight path (publish, relay, chain repair).

Every event is a flat record `{"t": unix seconds at the source, "kind": ..., **fields}`. The
publisher logs into an `EventLog` directly; relays buffer their records in their own process and
the relay group drains them into the same log (`EventLog.add`), so the source timestamp is kept.
`EventLog(forward=run_writer.log_event)` also routes each record to a run folder's
events.jsonl (where "time" is the write time and "t" the moment the event happened).

Kinds used by the weights package:
  publish_start, publish_returned, publish_superseded, publish_written, publish_failed,
  publish_announced                         (learner side, `publish.Publisher`)
  master_restored, chunk_rejected, chunk_lost, version_dropped, version_aborted,
  relay_received, relay_resend, store_pruned, publish_skipped, relay_error,
  publish_incomplete (a multi-host version with a learner host's shards missing or torn)
                                            (relay side, `relay.RelayWorker`)
  stream_error, stream_fallback             (relay-to-relay TCP streams, `stream`: a failed
                                            connect, send or read, and a link that switched to
                                            the object store)
  relay_started, relay_dead, relink, master_failover   (`relay_group.RelayGroup`)
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

__all__ = ["EventLog", "record"]


def record(kind: str, **fields: Any) -> dict:
    """One timestamped event record."""
    if "t" in fields or "kind" in fields:
        raise ValueError(f"event {kind!r}: fields 't' and 'kind' are set by the sink")
    return {"t": time.time(), "kind": kind, **fields}


class EventLog:
    """Thread-safe in-memory event log; call it like `RunWriter.log_event(kind, **fields)`.

    Args:
      forward: optional `(kind, **fields)` callable that receives every record as it is added
        (e.g. `RunWriter.log_event`); "t" is passed along as a field.
    """

    def __init__(self, forward: Callable[..., None] | None = None):
        self._forward = forward
        self._records: list[dict] = []
        self._lock = threading.Lock()

    def __call__(self, kind: str, **fields: Any) -> None:
        self.add(record(kind, **fields))

    def add(self, rec: dict) -> None:
        """Adds a record made elsewhere (a relay's), keeping its source timestamp."""
        if "t" not in rec or "kind" not in rec:
            raise ValueError(f"event record needs 't' and 'kind', got keys {sorted(rec)}")
        with self._lock:
            self._records.append(dict(rec))
        if self._forward is not None:
            self._forward(rec["kind"], **{k: v for k, v in rec.items() if k != "kind"})

    def extend(self, recs: list[dict]) -> None:
        for rec in recs:
            self.add(rec)

    def records(self, kind: str | None = None, **match: Any) -> list[dict]:
        """Records in time order, optionally only those of `kind` whose fields equal `match`."""
        with self._lock:
            out = list(self._records)
        out = [r for r in out if (kind is None or r["kind"] == kind)
               and all(r.get(k) == v for k, v in match.items())]
        return sorted(out, key=lambda r: r["t"])
