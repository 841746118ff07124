"""A rollout reading the weight store itself (`StoreSource`: relays off, or none answers) while the
master prunes: the read goes through a pin (`master.read_pinned`, hard links tagged with the
reader's pid), so a prune of the version being read does not pull its files away. Real orbax,
a real prune (`master.prune`); the prune is made to land inside the read by running it just
before orbax's restore starts.
"""
import os
import subprocess

import numpy as np
from flax import nnx

from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder
from laminar_jax.weights import master, publish
from laminar_jax.weights.events import EventLog
from laminar_jax.weights.source import StoreSource

CFG = DecoderConfig.preset("tiny")


def _written(tmp_path, versions):
    store = publish.WeightStore.local(str(tmp_path / "store"))
    pub = publish.Publisher(store, dtype="float32", events=EventLog())
    params = nnx.to_pure_dict(nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)), nnx.Param)[1])
    try:
        for v in versions:
            pub.publish(v, {**params, "embedding": np.asarray(params["embedding"]) + v})
            pub.wait_until_written()
    finally:
        pub.close()
    return store, np.asarray(params["embedding"])


def test_a_store_read_survives_the_master_pruning_that_version(tmp_path, monkeypatch):
    store, embedding = _written(tmp_path, [1, 2])
    role = master.MasterRole(store=store, cfg=CFG, chain_length=1)
    restore, pruned, listed = publish._restore_numpy, [], []

    def prune_then_restore(path):
        # the master took v3 meanwhile: it prunes everything older, v2 (being read) included
        pruned.extend(master.prune(role, 3))
        listed.extend(os.listdir(store.root))
        return restore(path)
    monkeypatch.setattr(publish, "_restore_numpy", prune_then_restore)

    got = StoreSource(store, CFG).newer_than(0)
    assert pruned == [1, 2] and store.versions() == []
    assert listed == [f"v0000000002.reader-{os.getpid()}"], listed   # only the reader's pin was left
    assert got is not None, "the read failed under the prune"
    version, tensors = got
    assert version == 2
    np.testing.assert_array_equal(np.asarray(tensors["model.embed_tokens.weight"]), embedding + 2)
    assert os.listdir(store.root) == [], "the pin is removed after the read"


def test_prune_removes_what_dead_readers_and_a_dead_prune_left_only(tmp_path):
    store, _ = _written(tmp_path, [1])
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = [f"v0000000001.reader-{dead.pid}", f"v0000000001.pruned-{dead.pid}",
            f"v0000000001.standby-{dead.pid}"]
    alive = f"v0000000001.reader-{os.getppid()}"   # a live process, not this one (its pin)
    for name in left + [alive]:
        os.makedirs(os.path.join(store.root, name, "d"))
    assert master.prune(master.MasterRole(store=store, cfg=CFG, chain_length=1), 1) == []
    assert sorted(os.listdir(store.root)) == ["v0000000001", alive]
    assert master.read_pinned(store, 1) is not None and store.versions() == [1]
    store.delete(1)   # renamed, then removed: nothing of it is left
    assert os.listdir(store.root) == [alive] and master.read_pinned(store, 1) is None
