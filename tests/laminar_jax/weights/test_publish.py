"""weights/publish.py: orbax async publish into a versioned weight store (real orbax, no Ray)."""
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from laminar_jax import sharding as shd
from laminar_jax.learner import train_state as ts
from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder
from laminar_jax.weights import publish
from laminar_jax.weights.events import EventLog

CFG = DecoderConfig.preset("tiny")

class _Master:
    """Stands in for the master relay's actor handle: records `publish.remote` calls."""

    def __init__(self):
        self.calls = []
        self.publish = self
        self.done = threading.Event()

    def remote(self, version, path):
        self.calls.append((version, path))
        self.done.set()


class _GatedCheckpointer:
    """A real orbax AsyncCheckpointer whose completion the test releases (slow storage)."""

    def __init__(self):
        self.inner = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
        self.gate = threading.Event()
        self.saving = threading.Event()

    def save(self, *args, **kwargs):
        self.saving.set()
        return self.inner.save(*args, **kwargs)

    def wait_until_finished(self):
        self.gate.wait()
        self.inner.wait_until_finished()

    def close(self):
        self.gate.set()
        self.inner.close()


class _GatedPublisher(publish.Publisher):
    def __init__(self, *args, **kwargs):
        self.made = []
        super().__init__(*args, **kwargs)

    def _new_checkpointer(self):
        self.made.append(_GatedCheckpointer())
        return self.made[-1]


def _sharded_params():
    mesh = shd.make_mesh(2, 2, 2)
    init_fn = lambda: Decoder(CFG, rngs=nnx.Rngs(0))  # noqa: E731
    return ts.init_params(ts.shard_model(init_fn, mesh), init_fn)


def _bits(x):
    return np.asarray(x).view(np.uint16)


def test_publish_writes_rollout_dtype_and_announces(tmp_path):
    params = _sharded_params()
    assert len(params["layers"]["q_kernel"].sharding.device_set) == 8
    log, master = EventLog(), _Master()
    store = publish.WeightStore.local(str(tmp_path / "store"))
    pub = publish.Publisher(store, dtype="bfloat16", master=master, events=log)
    pub.publish(1, params)
    pub.wait_until_written()
    assert master.calls == [(1, store.path(1))]
    assert store.versions() == [1] and pub.latest_written == 1
    restored = publish.read_version(store, 1)
    want = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), params)
    got_leaves = jax.tree_util.tree_leaves_with_path(restored)
    assert len(got_leaves) == len(jax.tree.leaves(want))
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
    for path, value in got_leaves:
        assert isinstance(value, np.ndarray) and value.dtype == jnp.bfloat16
        assert np.array_equal(_bits(value), _bits(flat_want[path])), path
    kinds = [r["kind"] for r in log.records(version=1)]
    assert kinds[:2] == ["publish_start", "publish_returned"]
    assert "publish_written" in kinds and "publish_announced" in kinds
    # a new master is told the newest version again
    other = _Master()
    pub.set_master(other)
    assert other.calls == [(1, store.path(1))]
    pub.publish(2, params)
    pub.wait_until_written()
    assert publish.prune_store(store, 2) == [1] and store.versions() == [2]
    with pytest.raises(ValueError, match="not newer than the last published version 2"):
        pub.publish(2, params)
    with pytest.raises(ValueError, match="version must be an int >= 0"):
        pub.publish(-1, params)
    pub.close()


def test_newer_version_supersedes_a_queued_write_without_blocking(tmp_path):
    params = nnx.to_pure_dict(nnx.split(Decoder(CFG, rngs=nnx.Rngs(1)), nnx.Param)[1])
    log, master = EventLog(), _Master()
    store = publish.WeightStore.local(str(tmp_path / "store"))
    pub = _GatedPublisher(store, dtype="float32", master=master, events=log)
    # No write may finish yet: every publish below returns anyway (else this test would hang).
    pub.publish(1, params)
    (ckpt,) = pub.made
    assert ckpt.saving.wait(60)   # the writer is inside v1's write
    pub.publish(2, params)
    pub.publish(3, params)        # v2 never started: dropped; v1 is never cancelled
    assert [(r["version"], r["by"]) for r in log.records("publish_superseded")] == [(2, 3)]
    assert master.calls == [] and store.versions() == []
    ckpt.gate.set()
    pub.wait_until_written()
    assert master.calls == [(1, store.path(1)), (3, store.path(3))]   # in order, each complete
    assert store.versions() == [1, 3]
    assert not [n for n in os.listdir(store.root) if n not in ("v0000000001", "v0000000003")]
    restored = publish.read_version(store, 3)
    assert np.array_equal(restored["embedding"], np.asarray(params["embedding"]))
    assert len(log.records("publish_returned")) == 3
    pub.close()


def test_a_fast_donating_step_loop_gets_every_written_version_whole_and_in_order(tmp_path):
    """The learner's loop: publish, then an update that donates the params' buffers, faster
    than orbax writes. Each written version holds exactly the params published as it (the host
    copy is taken before publish returns), versions are announced in increasing order, the
    last one always lands, and no publish waits for a write."""
    params = {"w": jnp.zeros((64, 256), jnp.float32), "b": jnp.zeros((256,), jnp.float32)}
    update = jax.jit(lambda p: jax.tree.map(lambda x: x + 1.0, p), donate_argnums=0)
    log, master = EventLog(), _Master()
    store = publish.WeightStore.local(str(tmp_path / "store"))
    pub = publish.Publisher(store, dtype="float32", master=master, events=log)
    for version in range(1, 31):
        params = update(params)     # version v's params are all v
        pub.publish(version, params)
    pub.wait_until_written()
    announced = [v for v, _ in master.calls]
    assert announced == sorted(set(announced)) and announced[-1] == 30
    superseded = {r["version"] for r in log.records("publish_superseded")}
    assert set(announced) | superseded == set(range(1, 31)) and not set(announced) & superseded
    for v in store.versions():
        got = publish.read_version(store, v)
        assert np.all(got["w"] == v) and np.all(got["b"] == v), v
    assert not log.records("publish_failed")
    pub.close()


class _FailingCheckpointer:
    """A real orbax checkpointer whose save of version 2 fails (a full disk)."""

    def __init__(self):
        self.inner = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))

    def save(self, path, **kwargs):
        if str(path).endswith("v0000000002"):
            raise OSError("No space left on device")
        return self.inner.save(path, **kwargs)

    def wait_until_finished(self):
        self.inner.wait_until_finished()

    def close(self):
        self.inner.close()


def test_a_failed_write_is_reported_and_the_next_version_still_lands(tmp_path):
    params = {"w": jnp.ones((8, 8), jnp.float32)}
    log, master = EventLog(), _Master()
    store = publish.WeightStore.local(str(tmp_path / "store"))
    pub = publish.Publisher(store, dtype="float32", master=master, events=log)
    pub._checkpointer = _FailingCheckpointer()
    for version in (1, 2, 3):
        pub.publish(version, params)
        pub.wait_until_written()
    (failed,) = log.records("publish_failed")
    assert failed["version"] == 2 and "No space left on device" in failed["error"]
    assert [v for v, _ in master.calls] == [1, 3] and store.versions() == [1, 3]
    assert pub.latest_written == 3
    pub.close()


def test_store_paths_and_readability(tmp_path):
    store = publish.WeightStore(str(tmp_path), node_id="n1")
    assert store.path(12) == os.path.join(str(tmp_path), "v0000000012")
    assert store.readable_from("n1") and not store.readable_from("n2")
    assert publish.WeightStore(str(tmp_path), node_id="n1", shared=True).readable_from("n2")
    os.makedirs(store.path(3))
    os.makedirs(os.path.join(str(tmp_path), "v0000000004.orbax-checkpoint-tmp-17"))
    assert store.versions() == [3]
    store.delete(4, temporary=True)
    assert os.listdir(str(tmp_path)) == ["v0000000003"]
    with pytest.raises(ValueError, match="version must be an int >= 0"):
        store.path(-2)


def test_wait_until_written_is_bounded_and_names_the_stuck_write(tmp_path):
    """No un-timed wait on the weight path: a write that never finishes (gated storage) makes
    `wait_until_written` raise within its timeout, naming the version, instead of hanging."""
    params = nnx.to_pure_dict(nnx.split(Decoder(CFG, rngs=nnx.Rngs(1)), nnx.Param)[1])
    pub = _GatedPublisher(publish.WeightStore.local(str(tmp_path / "store")), dtype="float32")
    pub.publish(1, params)
    with pytest.raises(TimeoutError, match="publish-v1 still writing"):
        pub.wait_until_written(timeout_s=0.3)
    pub.made[0].gate.set()
    pub.wait_until_written(timeout_s=60)
    assert pub.latest_written == 1
    pub.close()
