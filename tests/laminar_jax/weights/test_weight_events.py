"""weights/events.py: the event sink, and its routing into a run folder's events.jsonl."""
import json

import pytest

from laminar_jax.metrics import RunWriter
from laminar_jax.weights.events import EventLog, record


def test_records_keep_source_time_order_and_filter():
    log = EventLog()
    late = record("relay_received", relay="b", version=2)
    early = dict(record("relay_received", relay="a", version=2), t=late["t"] - 5.0)
    log.add(late)
    log.add(early)
    log("publish_start", version=3)
    assert [r["relay"] for r in log.records("relay_received")] == ["a", "b"]
    assert log.records("relay_received", relay="b") == [late]
    assert [r["kind"] for r in log.records(version=3)] == ["publish_start"]
    with pytest.raises(ValueError, match="'t' and 'kind' are set by the sink"):
        log("x", t=1.0)
    with pytest.raises(ValueError, match="needs 't' and 'kind'"):
        log.add({"kind": "x"})


def test_forwarding_to_run_writer_writes_events_jsonl(tmp_path):
    with RunWriter(tmp_path, tensorboard=False) as writer:
        log = EventLog(forward=writer.log_event)
        log("publish_returned", version=1, blocked_s=0.01)
        relay_rec = record("chunk_rejected", relay="n2", version=4, chunk=3, reason="crc32 ...")
        log.add(relay_rec)
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["publish_returned", "chunk_rejected"]
    assert lines[1]["t"] == relay_rec["t"] and lines[1]["chunk"] == 3 and "time" in lines[1]
    assert lines[0]["blocked_s"] == 0.01
