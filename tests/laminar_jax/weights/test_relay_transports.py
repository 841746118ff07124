"""Both relay transports on an emulated 4-node Ray cluster: equal bytes, and damaged chunks on a
real TCP stream are rejected.

One tcp chain and one object-store chain of 4 relays share one weight store (the learner is this
test process, unsharded). Every relay sits on its own raylet. The tcp chain streams the chunk bytes
through the relays' sockets even on this one host (`shared_links=False`, as between hosts) and
serves each version from shared memory. The object-store chain has shared memory off: chunks go
through the raylets' stores and each version is served through the node's object store (the
`via_*` counts of each relay's relay_received event say which way the chunks came). The chain of four over tcp with a relay killed
mid-broadcast, and the master failover, are in test_relay_cluster.py (tcp is the default there).
"""
import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray
from flax import nnx

from laminar_jax.models import hf
from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder
from laminar_jax.weights import flat, publish, shared_buffer, stream
from laminar_jax.weights.events import EventLog
from laminar_jax.weights.relay import pull, read
from laminar_jax.weights.relay_group import RelayGroup
from tests.laminar_jax.weights.weights_fixtures import wait_for

pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")

CFG = DecoderConfig.preset("tiny")
NUM_NODES = 4
CHUNKS = 6
ONE_DEVICE = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}}


@pytest.fixture(scope="module")
def groups(relay_cluster, tmp_path_factory):
    made = []
    try:
        head = ray.get_runtime_context().get_node_id()
        nodes = [head] + sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
        log = EventLog()
        store = publish.WeightStore(str(tmp_path_factory.mktemp("weights") / "store"),
                                    node_id=head, shared=False)
        pub = publish.Publisher(store, dtype="bfloat16", events=log)
        made.append(pub)
        common = dict(nodes=nodes, num_chunks=CHUNKS, runtime_env=ONE_DEVICE,
                      stream_timeout_s=10.0, fetch_timeout_s=30.0)
        tcp = RelayGroup(CFG, store, publisher=pub, transport="tcp", prefix="tt-tcp", events=log,
                         shared_links=False, **common)
        made.append(tcp)
        obj_log = EventLog()   # relays are named by node: one log per group
        objs = RelayGroup(CFG, store, transport="object_store", prefix="tt-obj", events=obj_log,
                          shared_memory=False, **common)
        made.append(objs)
        yield {"tcp": tcp, "object_store": objs, "pub": pub, "store": store, "log": log,
               "obj_log": obj_log,
               "versions": itertools.count(1)}
    finally:
        for m in reversed(made):
            m.close() if isinstance(m, publish.Publisher) else m.shutdown()


def _params(seed):
    return nnx.to_pure_dict(nnx.split(Decoder(CFG, rngs=nnx.Rngs(seed)), nnx.Param)[1])


def _expected(params):
    cast = jax.tree.map(lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16)), params)
    return flat.flatten(hf.params_to_hf(CFG, cast))


def _await(group, version):
    for node in group.order:
        got = pull(group.relay_for(node), newer_than=version - 1, timeout_s=60)
        assert got is not None and got[0] == version, f"{group.transport} relay {node}: {got and got[0]}"


def test_tcp_and_object_store_chains_deliver_equal_bytes_over_their_own_transport(groups):
    tcp, objs, log = groups["tcp"], groups["object_store"], groups["log"]
    assert [s["transport"] for s in tcp.status().values()] == ["tcp"] * NUM_NODES
    assert all(ray.get(r.stream_address.remote()) is None for r in objs.relays.values())
    params = _params(1)
    version = next(groups["versions"])
    groups["pub"].publish(version, params)
    _await(tcp, version)
    objs.master.publish.remote(version, groups["store"].path(version))
    _await(objs, version)
    want, want_index = _expected(params)
    for group in (tcp, objs):
        for node in group.order:
            got_version, buffer, index = pull(group.relay_for(node))
            assert (got_version, index) == (version, want_index)
            assert np.array_equal(buffer, want), f"{group.transport} relay {node}"
    tcp.collect_events()
    objs.collect_events()
    for group, events, via in ((tcp, log, "via_tcp"), (objs, groups["obj_log"], "via_object_store")):
        for node in group.order[1:]:
            rec, = events.records("relay_received", version=version, relay=node)
            assert (rec["via_tcp"] + rec["via_object_store"], rec[via]) == (CHUNKS, CHUNKS)
        assert events.records("stream_error") == [] and events.records("chunk_rejected") == []
    # served from shared memory (tcp chain: each relay process its own buffer) or from the node's
    # object store (object-store chain): read-only views, and two reads of one version in the
    # object store see the same bytes there (no copy)
    pids = {ray.get(tcp.relay_for(node).latest.remote()).handle.pid for node in tcp.order}
    assert len(pids) == NUM_NODES
    # a reader on another host cannot map the buffer: it gets an object-store copy instead, as
    # long as the relay still serves that version
    relay = tcp.relay_for(tcp.order[-1])
    snap = ray.get(relay.latest.remote())
    elsewhere = dataclasses.replace(snap, handle=dataclasses.replace(snap.handle, host="other:1"))
    assert np.array_equal(read(relay, elsewhere), want)
    with pytest.raises(shared_buffer.BufferGone):
        read(relay, dataclasses.replace(elsewhere, version=snap.version - 1))
    for node in objs.order:
        relay = objs.relay_for(node)
        snap = ray.get(relay.latest.remote())
        assert snap.handle is None and node in ray.experimental.get_object_locations(
            [snap.buffer])[snap.buffer]["node_ids"]
        first, again = read(relay, snap), read(relay, snap)
        assert not first.flags.writeable and first.ctypes.data == again.ctypes.data


def test_corrupt_or_truncated_chunk_on_a_tcp_stream_is_rejected_previous_version_served(groups):
    tcp, log = groups["tcp"], groups["log"]
    version = next(groups["versions"])
    groups["pub"].publish(version, _params(2))
    _await(tcp, version)
    third, fourth = tcp.order[2], tcp.order[3]
    relay = tcp.relay_for(third)
    _, good, index = pull(relay)
    bad1, bad2 = next(groups["versions"]), next(groups["versions"])
    fresh = np.random.default_rng(0).integers(0, 256, good.size, dtype=np.uint8)
    m1 = flat.make_manifest(bad1, fresh, index, CHUNKS)
    m2 = flat.make_manifest(bad2, fresh, index, CHUNKS)
    s, e = m1.chunks[0]
    corrupt = fresh[s:e].copy()
    corrupt[10] ^= 0x40
    # An upstream speaking the wire format on a real socket: a flipped bit, then a short chunk.
    sock = stream.connect(ray.get(relay.stream_address.remote()), 10.0, token=tcp.stream_token)
    try:
        def rejected(node, n):
            tcp.collect_events()
            return len(log.records("chunk_rejected", relay=node)) == n
        stream.write_manifest(sock, m1)
        stream.write_chunk(sock, m1, 0, corrupt)
        # (one at a time: a newer version arriving first would supersede the older unchecked)
        wait_for(lambda: rejected(third, 1), what="the crc32 rejection")
        stream.write_manifest(sock, m2)
        stream.write_chunk(sock, m2, 0, fresh[s:e - 5])
        wait_for(lambda: rejected(third, 2), what="the length rejection")
        reasons = [r["reason"] for r in log.records("chunk_rejected", relay=third)]
        assert "crc32" in reasons[0] and "truncated" in reasons[1]
        # the corrupt chunk was forwarded before the check (cut-through): the next relay
        # checks it against the master's crc32 itself and rejects it too
        wait_for(lambda: len(log.records("chunk_rejected", relay=fourth, version=bad1)) == 1,
              what="the downstream rejection")
        for node in (third, fourth):
            got_version, buffer, _ = pull(tcp.relay_for(node))
            assert got_version == version and np.array_equal(buffer, good)
        # a later, intact chunk of a rejected version is ignored, never served
        stream.write_chunk(sock, m1, 1, fresh[slice(*m1.chunks[1])])
        assert ray.get(relay.wait_newer.remote(version, 1.0)) is None
        assert ray.get(relay.status.remote())["arriving"] is None
    finally:
        sock.close()
    # the chain still works after the damaged stream
    version = next(groups["versions"])
    params = _params(3)
    groups["pub"].publish(version, params)
    _await(tcp, version)
    assert np.array_equal(pull(tcp.relay_for(fourth))[1], _expected(params)[0])
