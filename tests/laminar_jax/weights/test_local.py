"""`InProcessWeights` (run.colocate): a rollout in the learner's process gets, for each version,
the tensors a rollout reading the weight store would get (the same cast, the same HF layout),
without a store; only newer versions are served, and a waiting rollout wakes on the publish."""
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder
from laminar_jax.weights import publish
from laminar_jax.weights.events import EventLog
from laminar_jax.weights.local import InProcessWeights
from laminar_jax.weights.source import StoreSource

CFG = DecoderConfig.preset("tiny")


def _params(shift: float = 0.0) -> dict:
    params = nnx.to_pure_dict(nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)), nnx.Param)[1])
    return {**params, "embedding": np.asarray(params["embedding"]) + shift}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_version_in_memory_equals_the_weight_store_s(tmp_path, dtype):
    params = _params(0.5)
    store = publish.WeightStore.local(str(tmp_path / "store"))
    pub = publish.Publisher(store, dtype=dtype, events=EventLog())
    try:
        pub.publish(3, params)
        pub.wait_until_written()
    finally:
        pub.close()
    from_store = StoreSource(store, CFG).newer_than(-1)
    local = InProcessWeights(CFG, dtype)
    local.publish(3, params)
    got = local.newer_than(-1)
    assert got[0] == from_store[0] == 3
    assert sorted(got[1]) == sorted(from_store[1])
    for name, want in from_store[1].items():
        assert got[1][name].dtype == want.dtype == (ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
        np.testing.assert_array_equal(got[1][name], want, err_msg=name)


def test_only_newer_versions_are_served_and_a_publish_must_be_newer():
    local = InProcessWeights(CFG, "float32")
    assert local.newer_than(-1) is None and local.newest_published() is None
    local.publish(0, _params())
    assert local.newer_than(-1)[0] == 0 and local.newer_than(0) is None
    with pytest.raises(ValueError, match="version 0 is not newer than the last published version 0"):
        local.publish(0, _params())
    with pytest.raises(ValueError, match="version must be an int >= 0"):
        local.publish(-1, _params())


def test_the_copy_outlives_the_learner_s_next_update_donating_its_params():
    """The next update donates the learner's device buffers: a version kept by reference would be
    deleted under the rollout (or change with the params); the published copy must not."""
    import jax

    params = jax.tree.map(jax.numpy.asarray, _params())
    want = np.asarray(params["embedding"]).copy()
    local = InProcessWeights(CFG, "float32")
    local.publish(1, params)
    update = jax.jit(lambda p: jax.tree.map(lambda x: x + 1.0, p), donate_argnums=0)
    params = update(params)
    np.testing.assert_array_equal(local.newer_than(0)[1]["model.embed_tokens.weight"], want)


def test_a_waiting_rollout_wakes_on_the_publish_not_at_its_timeout():
    local = InProcessWeights(CFG, "float32")
    local.publish(0, _params())
    assert local.wait_newer(0, 0.2) is None   # nothing newer: the timeout
    got, t0 = {}, time.perf_counter()

    def wait():
        got["v"] = local.wait_newer(0, 30.0)
        got["s"] = time.perf_counter() - t0

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.2)
    local.publish(1, _params(1.0))
    t.join(30)
    assert got["v"][0] == 1 and got["s"] < 10.0, got.get("s")
