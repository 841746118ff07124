"""weights/master.py: how the master picks the chunk count, and its checkpoint -> chunks step."""
import numpy as np
import pytest

from laminar_jax.models import hf
from laminar_jax.models.config import DecoderConfig
from laminar_jax.weights import flat, master, publish
from laminar_jax.weights.chain import optimal_chunks


def _role(**kw):
    return master.MasterRole(store=None, cfg=None, **kw)


@pytest.mark.parametrize("p, model_bytes", [(4, 10 * 2**20), (8, 2**30), (128, 2**32)])
def test_chunk_count_follows_the_time_model_when_chunks_are_small(p, model_bytes):
    role = _role(chain_length=p, max_chunk_bytes=2**40)
    assert role.chunks_for(model_bytes) == optimal_chunks(p, model_bytes, 1e-9, 2e-3, max_chunks=256)


def test_chunk_count_keeps_chunks_under_the_byte_cap_and_honours_a_fixed_k():
    # p = 2: the time model alone says one chunk; the cap splits a 1 GiB model into 16
    assert _role(chain_length=2).chunks_for(2**30) == 16
    assert _role(chain_length=2).chunks_for(1000) == 1
    assert _role(chain_length=2, max_chunks=8).chunks_for(2**30) == 8
    assert _role(chain_length=9, num_chunks=5).chunks_for(2**30) == 5
    assert _role(chain_length=9, num_chunks=5).chunks_for(3) == 3


def test_prepare_gives_the_engine_layout_of_the_stored_version(tmp_path, monkeypatch):
    cfg = DecoderConfig.preset("tiny")
    rng = np.random.default_rng(0)
    tensors = {e.hf_name: rng.standard_normal(e.hf_shape).astype(np.float32) for e in hf.name_map(cfg)}
    params = hf.hf_to_params(cfg, tensors)
    store = publish.WeightStore.local(str(tmp_path / "store"))
    pub = publish.Publisher(store, dtype="float32")
    pub.publish(3, params)
    pub.wait_until_written()
    role = master.MasterRole(store=store, cfg=cfg, chain_length=4, num_chunks=7)
    manifest, buffer, timings = master.prepare(role, 3, store.path(3))
    want, index = flat.flatten(tensors)
    assert np.array_equal(buffer, want) and manifest.index == index
    assert manifest.version == 3 and manifest.num_chunks == 7
    assert all(flat.check_chunk(manifest, i, buffer[s:e]) is None
               for i, (s, e) in enumerate(manifest.chunks))
    assert set(timings) == {"read_s", "convert_s", "checksum_s"}
    pub.publish(4, params)
    pub.wait_until_written()
    assert master.prune(role, 4) == [3] and store.versions() == [4]
    # a master promoted on another node that sees the store's folder (another node of the same
    # host) prunes it itself: no task on the store's node, whose worker start costs seconds
    elsewhere = master.MasterRole(store=publish.WeightStore(store.root, node_id="another-node"), cfg=cfg,
                                  chain_length=4)
    assert not elsewhere.store.readable_from("this-node")
    monkeypatch.setattr(publish, "_on_store_node", lambda *a: pytest.fail("pruned through a task"))
    pub.publish(5, params)
    pub.wait_until_written()
    assert master.prune(elsewhere, 5) == [4] and store.versions() == [5]
    pub.close()
