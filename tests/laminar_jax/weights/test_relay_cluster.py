"""Relays on an emulated 4-node Ray cluster: publish, chain broadcast, pull, faults.

Relays use the defaults: TCP streams between relays, version buffers in shared memory. The nodes
share this one host, so every link is a same-host one: a relay shares its upstream's buffer and
checks each chunk as the upstream announces it, and rollouts map their relay's buffer (test_relay_transports.py covers bytes on the
sockets, the object-store transport and serving through the object store). Real Ray (each node its
own raylet and object store), real orbax. The learner is this test process (8 fake CPU devices from conftest); relay processes get 1
device, so every restore crosses topologies. One cluster and one relay group serve the whole
module (start-up dominates CI time); the tests run in file order and the last two are the
destructive ones (a relay, then the master, is killed). The weight store sits on the head node's
tmpfs, not shared: after the master failover the new master reads it through a pinned task.
"""
import itertools
import mmap
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray
from flax import nnx
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from laminar_jax import sharding as shd
from laminar_jax.learner import train_state as ts
from laminar_jax.models import hf
from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder
from laminar_jax.weights import flat, host_shards, publish, shared_buffer
from laminar_jax.weights.events import EventLog
from laminar_jax.weights.relay import pull
from laminar_jax.weights.relay_group import RelayGroup, local_relay
from tests.laminar_jax.weights.weights_fixtures import wait_for
from rollout.engine import Request, SamplingParams, run_to_completion
from rollout.jax_engine import JaxEngine

# Ray starts its node processes with fork+exec after JAX is loaded; exec makes that safe.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")

CFG = DecoderConfig.preset("tiny")
NUM_NODES = 4
CHUNKS = 8
ONE_DEVICE = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}}


class Stack:
    """Learner-side publisher plus the relay group, shared by the module's tests."""

    def __init__(self, store_dir):
        self.head = ray.get_runtime_context().get_node_id()
        others = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != self.head)
        self.nodes = [self.head] + others
        self.log = EventLog()
        self.store = publish.WeightStore(str(store_dir), node_id=self.head, shared=False)
        self.pub = publish.Publisher(self.store, dtype="bfloat16", events=self.log)
        self.group = RelayGroup(CFG, self.store, nodes=self.nodes, publisher=self.pub,
                                events=self.log, num_chunks=CHUNKS, prefix="test-relay",
                                runtime_env=ONE_DEVICE, fetch_timeout_s=30.0, transport="tcp",
                                stream_timeout_s=30.0, max_restarts=0)   # restarts: the last test
        self._versions = itertools.count(1)
        init_fn = lambda: Decoder(CFG, rngs=nnx.Rngs(0))  # noqa: E731
        self.sharded = ts.init_params(ts.shard_model(init_fn, shd.make_mesh(2, 2, 2)), init_fn)
        self._shift = jax.jit(lambda tree, d: jax.tree.map(lambda x: x + d, tree))

    def version(self) -> int:
        return next(self._versions)

    def params(self, seed: int):
        """Sharded learner params, distinct per seed (same shardings, no recompile)."""
        return self._shift(self.sharded, jnp.float32(seed) * 1e-3)

    def publish_everywhere(self, seed: int):
        """Publishes the params of `seed` as a new version and waits until every relay has it;
        returns (version, params)."""
        params, version = self.params(seed), self.version()
        self.pub.publish(version, params)
        _await_version(self.group, version)
        return version, params


@pytest.fixture(scope="module")
def stack(relay_cluster, tmp_path_factory):
    st = None
    try:
        st = Stack(tmp_path_factory.mktemp("weights") / "store")
        yield st
    finally:
        if st is not None:
            st.group.shutdown()
            st.pub.close()


def _await_version(group, version, nodes=None):
    """Every relay of `nodes` (default: every live relay) serves `version`. A relay found dead
    meanwhile (the monitor has not taken it out of the group yet) is asked again once it has:
    gone from the group, it is no longer a live relay; replaced, its successor must serve it."""
    deadline = time.monotonic() + 90
    pending = list(nodes or group.order)
    while pending:
        node = pending[0]
        if nodes is None and node not in group.order:
            pending.pop(0)
            continue
        try:
            got = pull(group.relay_for(node), newer_than=version - 1, timeout_s=max(1.0, deadline - time.monotonic()))
        except (ray.exceptions.ActorDiedError, KeyError):
            assert time.monotonic() < deadline, f"relay {node} never got version {version}"
            time.sleep(0.02)
            continue
        assert got is not None and got[0] >= version, f"relay {node} never got version {version}"
        pending.pop(0)


def _expected(params):
    """The learner's params cast to the rollout dtype, in the engine layout, independently of
    flat.params_to_flat: HF tensors from models.hf, cast on the learner's devices."""
    cast = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), params)
    return flat.flatten(hf.params_to_hf(CFG, cast))


def test_publish_then_pull_every_relay_sharded_and_unsharded(stack):
    group, pub, log = stack.group, stack.pub, stack.log
    assert len(set(group.order)) == NUM_NODES and group.master_node == stack.head
    sharded = stack.params(1)
    assert len(sharded["layers"]["q_kernel"].sharding.device_set) == 8
    unsharded = nnx.to_pure_dict(nnx.split(Decoder(CFG, rngs=nnx.Rngs(1)), nnx.Param)[1])
    versions = []
    for params in (sharded, unsharded):
        version = stack.version()
        versions.append(version)
        pub.publish(version, params)
        _await_version(group, version)
        want, want_index = _expected(params)
        for node in group.order:
            got_version, buffer, index = pull(group.relay_for(node))
            assert got_version == version and index == want_index
            assert np.array_equal(buffer, want), f"relay {node} holds different bytes"
    # relays on one host share one copy of the version: each serves it under its own fd (so it
    # outlives any other relay), and every one of them checked every chunk itself
    handles = [ray.get(group.relay_for(node).latest.remote()).handle for node in group.order]
    assert len({h.pid for h in handles}) == NUM_NODES and os.getpid() not in {h.pid for h in handles}
    assert {h.host for h in handles} == {shared_buffer.host_key()}
    assert len({h.inode for h in handles}) == 1
    # each relay holds one complete version and nothing arriving; the store keeps the newest
    assert all(s["version"] == versions[1] and s["arriving"] is None for s in group.status().values())
    wait_for(lambda: stack.store.versions() == [versions[1]], what="store pruning")
    group.collect_events()
    assert versions[0] in log.records("store_pruned")[-1]["versions"]
    received = {r["relay"]: r for r in log.records("relay_received", version=versions[1])}
    assert set(received) == set(group.order)
    # every chunk reached every relay over its stream, copied from the upstream's shared buffer
    assert all((received[n]["via_shared_memory"], received[n]["via_tcp"],
                received[n]["via_object_store"]) == (CHUNKS, 0, 0) for n in group.order[1:])


def test_rollout_on_a_relay_node_reads_without_copy_and_gets_learner_logits(stack):
    group = stack.group
    version, params = stack.publish_everywhere(2)
    tail = group.order[-1]

    @ray.remote(num_cpus=0)
    def rollout_pull(prefix):
        relay = local_relay(prefix)
        got_version, buffer, index = pull(relay)
        handle = ray.get(relay.latest.remote()).handle
        mapped = (isinstance(getattr(buffer.base, "obj", None), mmap.mmap)
                  and handle.pid != os.getpid())
        return (got_version, bool(buffer.flags.writeable), mapped,
                ray.get_runtime_context().get_node_id(), np.asarray(buffer).copy(), index)

    strategy = NodeAffinitySchedulingStrategy(tail, soft=False)
    got_version, writeable, same_memory, node, buffer, index = ray.get(
        rollout_pull.options(scheduling_strategy=strategy).remote(group.prefix))
    assert (got_version, node) == (version, tail)
    # a read-only mapping of the relay process's buffer, not a copy
    assert not writeable and same_memory
    # A Decoder loaded from the pulled buffer gives the logits of the learner's params cast to
    # bfloat16 (the next test does the same through the rollout engine's generations).
    pulled = flat.flat_to_params(CFG, buffer, index)
    cast = jax.tree.map(lambda x: jax.device_get(x.astype(jnp.bfloat16)), params)
    graphdef = nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)), nnx.Param)[0]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 16)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))

    def logits(tree):
        return np.asarray(nnx.merge(graphdef, jax.tree.map(jnp.asarray, tree))(tokens, positions))
    got, want = logits(pulled), logits(cast)
    assert np.isfinite(want).all()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# The rollout engine keeps bfloat16 params (the published dtype) and computes in float32.
ENGINE_CFG = CFG.replace(param_dtype="bfloat16")
# One row bucket and one window bucket: one prefill and one decode compile per engine.
ENGINE_KW = dict(max_num_seqs=4, min_rows=4, page_size=8, max_model_len=32, min_window_pages=4)


def _greedy_requests():
    rng = np.random.default_rng(3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    return [Request(f"p{i}", rng.integers(0, CFG.vocab_size, n), greedy) for i, n in enumerate((5, 9, 12))]


def _continuations(done):
    return {rid: (c.response_tokens.tolist(), c.raw_logp.view(np.uint32).tolist(), c.logp.view(np.uint32).tolist(),
                  c.versions.tolist(), c.weight_version) for rid, c in sorted(done.items())}


def test_jax_engine_on_a_relay_node_loads_the_pulled_version_and_generates_with_it(stack):
    group = stack.group
    version, params = stack.publish_everywhere(7)
    tail = group.order[-1]
    # The engine starts on other weights: an independent random init, in the rollout dtype.
    start = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)),
                         nnx.to_pure_dict(nnx.split(Decoder(CFG, rngs=nnx.Rngs(11)), nnx.Param)[1]))

    @ray.remote(num_cpus=0)
    def rollout_engine(prefix, start_params):
        got_version, buffer, index = pull(local_relay(prefix))
        engine = JaxEngine(ENGINE_CFG, start_params, weight_version=0, **ENGINE_KW)
        before = run_to_completion(engine, _greedy_requests())
        engine.load_weights(flat.unflatten(buffer, index), got_version)
        after = run_to_completion(engine, _greedy_requests())
        return got_version, ray.get_runtime_context().get_node_id(), _continuations(before), _continuations(after)

    strategy = NodeAffinitySchedulingStrategy(tail, soft=False)
    got_version, node, before, after = ray.get(
        rollout_engine.options(scheduling_strategy=strategy).remote(group.prefix, start))
    assert (got_version, node) == (version, tail)
    # Reference: an engine built directly from the learner's params cast to bfloat16.
    cast = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), params)
    want = _continuations(run_to_completion(JaxEngine(ENGINE_CFG, cast, weight_version=version, **ENGINE_KW),
                                            _greedy_requests()))
    # same tokens, bit-identical raw (and greedy = raw) log-probs, every token stamped `version`
    assert after == want
    assert all(c[3] == [version] * 8 and c[4] == version for c in after.values())
    assert all(np.isfinite(np.asarray(c[1], np.uint32).view(np.float32)).all() for c in after.values())
    # before the load the engine produced something else, so the comparison above could fail
    assert all(before[rid][3] == [0] * 8 for rid in before)
    assert all(before[rid][1] != after[rid][1] for rid in after)
    assert any(before[rid][0] != after[rid][0] for rid in after)


def test_corrupt_or_truncated_chunk_is_rejected_and_previous_version_served(stack):
    group, log = stack.group, stack.log
    version = stack.version()
    stack.pub.publish(version, stack.params(3))
    _await_version(group, version)
    node = group.order[2]
    relay = group.relay_for(node)
    _, good, index = pull(relay)
    # An upstream that sends damaged bytes for the next two versions.
    bad1, bad2 = stack.version(), stack.version()
    fresh = np.random.default_rng(0).integers(0, 256, good.size, dtype=np.uint8)
    manifest = flat.make_manifest(bad1, fresh, index, CHUNKS)
    s, e = manifest.chunks[0]
    corrupt = fresh[s:e].copy()
    corrupt[10] ^= 0x40

    def rejected(n):
        group.collect_events()
        return len(log.records("chunk_rejected", relay=node)) == n
    # One at a time: the relay is a threaded actor, so two offers in flight may reach its loop in
    # either order, and the newer version's rejection would make the older one not needed.
    relay.offer.remote(manifest, 0, [ray.put(corrupt)])
    wait_for(lambda: rejected(1), what="the crc32 rejection")
    relay.offer.remote(flat.make_manifest(bad2, fresh, index, CHUNKS), 0, [ray.put(fresh[s:e - 5])])
    wait_for(lambda: rejected(2), what="the length rejection")
    reasons = [r["reason"] for r in log.records("chunk_rejected", relay=node)]
    assert "crc32" in reasons[0] and "truncated" in reasons[1]
    got_version, buffer, _ = pull(relay)
    assert got_version == version and np.array_equal(buffer, good)
    # a later, intact chunk of a rejected version is ignored, never served
    relay.offer.remote(manifest, 1, [ray.put(fresh[slice(*manifest.chunks[1])])])
    assert ray.get(relay.wait_newer.remote(version, 1.0)) is None
    assert ray.get(relay.status.remote())["arriving"] is None


def test_fanout_topology_delivers_the_same_bytes(stack):
    """The benchmark's naive baseline: the master sends every chunk to every relay itself."""
    version = stack.pub.latest_written
    fan = RelayGroup(CFG, stack.store, nodes=stack.nodes, topology="fanout", num_chunks=3,
                     prefix="test-fanout", runtime_env=ONE_DEVICE)
    try:
        assert [s["downstream"] for s in fan.status().values()] == [NUM_NODES - 1, 0, 0, 0]
        fan.master.publish.remote(version, stack.store.path(version))
        _await_version(fan, version)
        want = pull(stack.group.master)[1]
        for node in fan.order:
            assert np.array_equal(pull(fan.relay_for(node))[1], want), node
    finally:
        fan.shutdown()


def test_publish_returns_while_distribution_is_stalled(stack):
    group, log = stack.group, stack.log
    first, second = (group.relay_for(n) for n in group.order[:2])
    ray.get(second.hold.remote(0))      # the chain cannot get past the second relay
    version = stack.version()
    stack.pub.publish(version, stack.params(4))   # would never return if it waited for the chain
    returned = log.records("publish_returned", version=version)
    assert len(returned) == 1
    wait_for(lambda: ray.get(first.status.remote())["version"] == version, what="the master")
    wait_for(lambda: ray.get(second.status.remote())["arriving"] == version, what="relay 2")
    assert all(s["version"] < version for s in list(group.status().values())[1:])
    ray.get(second.release.remote())
    _await_version(group, version)
    group.collect_events()
    received = {r["relay"]: r["t"] for r in log.records("relay_received", version=version)}
    assert set(received) == set(group.order)
    # every relay behind the stall completed after publish had returned
    assert all(returned[0]["t"] < received[n] for n in group.order[1:])


def test_chain_of_four_survives_killing_the_second_relay_mid_broadcast(stack):
    group, log = stack.group, stack.log
    first, second, third, fourth = group.order
    ray.get(group.relay_for(second).hold.remote(3))   # forwards chunks 0..2, then stalls
    params = stack.params(5)
    version = stack.version()
    stack.pub.publish(version, params)
    wait_for(lambda: ray.get(group.relay_for(fourth).status.remote())["arriving_chunks"] == 3,
          what="three chunks at the tail")
    ray.kill(group.relay_for(second), no_restart=True)
    wait_for(lambda: group.check() == [second], what="the heartbeat to see the dead relay")
    assert group.order == (first, third, fourth)
    _await_version(group, version)
    want = _expected(params)[0]
    for node in group.order:
        assert np.array_equal(pull(group.relay_for(node))[1], want), node
    group.collect_events()
    assert log.records("relay_dead")[-1]["relay"] == second
    assert log.records("relink")[-1]["order"] == [first, third, fourth]
    # only what the third relay lacked was resent, by the master
    resend = log.records("relay_resend", version=version)
    assert [(r["relay"], r["chunks"], r["transport"]) for r in resend] == [(first, CHUNKS - 3, "tcp")]
    tails = {r["relay"]: r for r in log.records("relay_received", version=version)}
    assert all(tails[n]["via_shared_memory"] == CHUNKS for n in (third, fourth))
    # a replacement relay on that node joins at the tail and gets the current version from it
    group.add(second)
    assert group.order == (first, third, fourth, second)
    _await_version(group, version, nodes=[second])
    assert np.array_equal(pull(group.relay_for(second))[1], want)


def test_master_failover_elects_next_relay_and_tells_the_publisher(stack):
    group, log, store = stack.group, stack.log, stack.store
    old_master, next_in_chain = group.order[:2]
    assert old_master == store.node_id
    ray.kill(group.master, no_restart=True)
    wait_for(lambda: group.check() == [old_master], what="the heartbeat to see the dead master")
    assert group.master_node == next_in_chain and not store.readable_from(next_in_chain)
    failover = log.records("master_failover")
    assert [(r["old"], r["new"]) for r in failover] == [(old_master, next_in_chain)]
    # the publisher was pointed at the new master and announced its newest version again
    latest = stack.pub.latest_written
    assert log.records("publish_announced", version=latest)[-1]["t"] > failover[0]["t"]
    version, params = stack.publish_everywhere(6)
    for node in group.order:
        assert np.array_equal(pull(group.relay_for(node))[1], _expected(params)[0]), node
    group.collect_events()
    assert [r["relay"] for r in log.records("master_restored", version=version)] == [next_in_chain]
    wait_for(lambda: store.versions() == [version], what="store pruning by the new master")


def _broadcast_s(stack, seed):
    """Seconds from publish until every relay serves the new version."""
    params, version = stack.params(seed), stack.version()
    t0 = time.perf_counter()
    stack.pub.publish(version, params)
    _await_version(stack.group, version)
    return time.perf_counter() - t0, version


def test_monitor_restarts_a_dead_relay_and_a_dead_master_is_replaced_within_seconds(stack):
    """The monitor (`start_monitor`) notices a death through the relay's open `watch` call: the
    version published right after the master is killed reaches every live relay within 2x a
    normal broadcast (median of three; issue #14's target): the next master in line is warm
    (`prepare_standby`; the master is killed once `standby_warm` says so), and the dead relay's
    restart waits for the new master's first broadcast. The dead relay's node then gets a new
    relay (`max_restarts`) that serves that version too."""
    group, log = stack.group, stack.log
    group.max_restarts = 2
    group.start_monitor(5.0)          # a long period: only the watch can make failover fast
    normal = sorted(_broadcast_s(stack, 20 + i)[0] for i in range(3))[1]
    old_master = group.master_node
    wait_for(lambda: group.standby_warm(), what="the standby in line to be warm and caught up")
    ray.kill(group.master, no_restart=True)
    failover_s, version = _broadcast_s(stack, 30)
    group.collect_events()
    t_dead = log.records("relay_dead")[-1]["t"]
    timeline = [(round(r["t"] - t_dead, 3), r["kind"], r.get("relay"), r.get("read_s"))
                for r in log.records() if r["t"] >= t_dead - 0.5 and r["kind"] not in ("publish_start", "publish_returned")][:30]
    print(f"normal broadcast {normal * 1e3:.0f} ms, after the master's death {failover_s * 1e3:.0f} ms "
          f"({failover_s / normal:.2f}x)")
    # the promoted master was the warmed standby (its first orbax restore paid ahead)
    new_master = group.master_node
    warmed = [r["relay"] for r in log.records("standby_ready") if r["warmed"]]
    assert new_master in warmed, (new_master, log.records("standby_ready"))
    # Measured (issue #14): 4.9-9x while every standby named before the learner's first publish
    # gave up ("weight store not visible", its folder did not exist yet) and the promoted master
    # restored cold; with the standby warm: see the README's "Master failover".
    assert failover_s <= 2.0 * normal, (failover_s, normal, timeline)
    # the dead relay's process was started only after the new master's first broadcast
    wait_for(lambda: old_master in group.relays, what="the dead master's node to get a relay again")
    group.collect_events()
    first_new = min(r["t"] for r in log.records("relay_received", version=version))
    restarted = [r["t"] for r in log.records("relay_started") if r["relay"] == old_master and r["t"] > t_dead]
    assert restarted and min(restarted) >= first_new, (restarted, first_new)
    assert group.master_node != old_master and old_master in group.order, group.order
    _await_version(group, version, nodes=[old_master])
    group.collect_events()
    assert [r["relay"] for r in log.records("relay_restarted")] == [old_master]


# last in the module: its torn versions sit in the shared store and group (the standby follows them)
def test_a_torn_or_incomplete_multi_host_version_is_not_served_and_names_the_host(stack):
    """A multi-host learner's version (per-host shards, weights/host_shards.py) with one host's
    shard torn, or one host's manifest missing: the master reports it (host and tensor) and
    keeps serving the previous version."""
    from tests.laminar_jax.weights.test_host_shards import write_version
    group, log = stack.group, stack.log
    good, _ = stack.publish_everywhere(4)
    tree = publish.read_version(stack.store, good)   # host numpy, bf16: what two hosts would write
    torn, partial = stack.version(), stack.version()
    try:
        _torn_and_partial(stack, group, log, tree, good, torn, partial, write_version)
    finally:   # the module's later groups (a fresh master serves the store's newest) start clean
        for v in (torn, partial):
            stack.store.delete(v, temporary=True)


def _torn_and_partial(stack, group, log, tree, good, torn, partial, write_version):
    path = write_version(stack.store.root, torn, tree)
    data = host_shards.data_path(path, 1)
    blob = bytearray(open(data, "rb").read())
    blob[7] ^= 0x01
    open(data, "wb").write(bytes(blob))
    group.master.publish.remote(torn, path)

    def incomplete(n):
        group.collect_events()
        return len(log.records("publish_incomplete")) == n
    wait_for(lambda: incomplete(1), what="the torn shard's report")
    rec = log.records("publish_incomplete")[0]
    assert rec["version"] == torn and rec["host"] == 1 and rec["tensor"] in rec["error"]
    path = write_version(stack.store.root, partial, tree)
    os.remove(host_shards.manifest_path(path, 0))
    group.master.publish.remote(partial, path)
    wait_for(lambda: incomplete(2), what="the missing manifest's report")
    rec = log.records("publish_incomplete")[1]
    assert rec["version"] == partial and rec["host"] == 0 and "missing" in rec["error"]
    for node in group.order:
        assert pull(group.relay_for(node))[0] == good
