"""The warm standby master (weights/standby.py) and the relay's clean stop, on a RelayWorker run
in-process (no Ray: loopback stream server, shared-memory buffers, no downstream), real orbax.

- The standby follows the store: each committed version it does not serve is prepared ahead,
  from a hard-linked pin the master's prune cannot pull files from under. Promotion then serves
  the newest version with no orbax read (`store_reads` counts every restore the relay makes),
  bytes equal to a master's own step; the next publish is a normal master step (one read).
- `stop()` lets the master step in hand finish before it returns (the store is removed after
  it: a restore whose files vanish fails half-way and prints "Event loop is closed"
  tracebacks), and a publish after it is ignored.
"""
import os
import shutil
import time

import numpy as np
from flax import nnx

from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder
from laminar_jax.weights import master, publish
from laminar_jax.weights.events import EventLog
from laminar_jax.weights.relay import RelayWorker

CFG = DecoderConfig.preset("tiny")


def _wait(pred, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.time() + timeout_s
    while not pred():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _publisher(tmp_path):
    store = publish.WeightStore.local(str(tmp_path / "store"))
    pub = publish.Publisher(store, dtype="float32", events=EventLog())
    params = nnx.to_pure_dict(nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)), nnx.Param)[1])

    def write(version: int) -> None:
        shifted = {k: v for k, v in params.items()}
        shifted["embedding"] = np.asarray(params["embedding"]) + version
        pub.publish(version, shifted)
        pub.wait_until_written()
    return store, pub, write


def _kinds(relay, kind):
    return [e for e in relay._events if e["kind"] == kind]


def test_promoted_standby_serves_the_newest_version_without_reading_the_store(tmp_path):
    store, pub, write = _publisher(tmp_path)
    write(1)
    write(2)
    role = master.MasterRole(store=store, cfg=CFG, chain_length=2, num_chunks=3)
    relay = RelayWorker("standby", host="127.0.0.1")
    try:
        relay.prepare_standby(role, wait_s=0.0)
        _wait(lambda: relay.status()["standby_prepared"] == 2, "the standby to prepare v2")
        assert relay.status()["warm"] and relay.status()["store_reads"] == 1
        write(3)    # the master would prune v2 now that it holds v3: the pin is unaffected
        _wait(lambda: relay.status()["standby_prepared"] == 3, "the standby to follow v3")
        assert relay.status()["store_reads"] == 2
        store.delete(2)
        assert not [n for n in os.listdir(store.root) if ".standby-" in n], "pins are removed after the read"

        relay.configure_master(role)                 # promotion: v3 is the store's newest
        _wait(lambda: relay.latest() is not None, "the promoted master to serve")
        snap = relay.latest()
        assert snap.version == 3
        assert relay.status()["store_reads"] == 2, "promotion read the store"
        (restored,) = _kinds(relay, "master_restored")
        assert restored["version"] == 3 and restored["standby"] is True
        want, _, _ = master.prepare(role, 3, store.path(3))   # a master's own step on v3
        from laminar_jax.weights import shared_buffer
        got = shared_buffer.open_handle(snap.handle)
        manifest = relay._versions.current[0]
        assert manifest == want and np.array_equal(got[:want.total_bytes], np.asarray(
            relay._versions.current[1].buffer))
        assert manifest.checksums == want.checksums

        write(4)                                     # an ordinary master step: one read
        relay.publish(4, store.path(4))
        _wait(lambda: relay.latest().version == 4, "v4")
        assert relay.status()["store_reads"] == 3
        assert [e["standby"] for e in _kinds(relay, "master_restored")] == [True, False]
    finally:
        relay.stop()
        pub.close()


def test_a_standby_named_before_the_store_exists_follows_its_first_version(tmp_path):
    # a group names its standby before the learner's first publish creates the store's folder:
    # judged "not visible" then, the standby gave up for good and the first failover restored
    # cold (7-9x a normal broadcast in test_relay_cluster)
    store = publish.WeightStore(str(tmp_path / "store"))
    role = master.MasterRole(store=store, cfg=CFG, chain_length=2, num_chunks=3)
    relay, pub = RelayWorker("standby", host="127.0.0.1"), None
    try:
        relay.prepare_standby(role)
        time.sleep(0.3)
        assert not os.path.isdir(store.root) and not _kinds(relay, "standby_ready")
        _, pub, write = _publisher(tmp_path)
        write(1)
        _wait(lambda: relay.status()["standby_prepared"] == 1, "the standby to prepare v1")
        assert [e["warmed"] for e in _kinds(relay, "standby_ready")] == [True]
        assert relay.status()["standby_caught_up"]
    finally:
        relay.stop()
        if pub is not None:
            pub.close()


def test_a_torn_newest_version_is_reported_once_and_the_next_one_is_prepared(tmp_path):
    # a committed version whose files are damaged stays damaged: one standby_error, not one per
    # poll (FOLLOW_POLL_S, 20 a second), and the next committed version is followed as usual
    store, pub, write = _publisher(tmp_path)
    write(1)
    for root, _, files in os.walk(store.path(1)):
        for name in files:
            if "metadata" not in name:
                open(os.path.join(root, name), "wb").close()   # truncated to nothing
    role = master.MasterRole(store=store, cfg=CFG, chain_length=2, num_chunks=3)
    relay = RelayWorker("standby", host="127.0.0.1")
    try:
        relay.prepare_standby(role, wait_s=0.0)
        _wait(lambda: _kinds(relay, "standby_error"), "the standby to fail on the torn v1")
        time.sleep(1.0)   # 20 polls
        assert [e["version"] for e in _kinds(relay, "standby_error")] == [1]
        assert relay.status()["store_reads"] == 0 and not relay.status()["standby_caught_up"]
        write(2)
        _wait(lambda: relay.status()["standby_prepared"] == 2, "the standby to prepare v2")
        assert [e["version"] for e in _kinds(relay, "standby_error")] == [1]
        assert relay.status()["standby_caught_up"]
    finally:
        relay.stop()
        pub.close()


def test_stop_waits_for_the_master_step_in_hand_and_ignores_later_publishes(tmp_path):
    store, pub, write = _publisher(tmp_path)
    write(1)
    role = master.MasterRole(store=store, cfg=CFG, chain_length=1)
    relay = RelayWorker("master", host="127.0.0.1")
    relay.configure_master(role)                     # restores v1 on the loop
    relay.stop()                                     # ... which ends before stop returns
    assert not relay._loop_thread.is_alive()
    assert [e["version"] for e in _kinds(relay, "master_restored")] == [1]
    assert relay.latest().version == 1
    shutil.rmtree(store.root)                        # the learner's close: safe now
    relay.publish(2, store.path(2))
    time.sleep(0.2)
    assert relay.latest().version == 1 and not _kinds(relay, "relay_error")
    pub.close()


def test_prune_removes_the_pins_of_dead_standbys_only(tmp_path):
    import subprocess
    store = publish.WeightStore.local(str(tmp_path / "store"))
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name in ("v0000000001", "v0000000002", f"v0000000001.standby-{dead.pid}",
                 f"v0000000002.standby-{os.getpid()}"):
        os.makedirs(os.path.join(store.root, name, "d"))
    role = master.MasterRole(store=store, cfg=CFG, chain_length=1)
    assert master.prune(role, 2) == [1]
    assert sorted(os.listdir(store.root)) == ["v0000000002", f"v0000000002.standby-{os.getpid()}"]
    assert store.versions() == [2]
