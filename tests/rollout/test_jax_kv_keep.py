"""Kept K/V across turns (`Request.keep_kv`, `env.kv_policy: keep`) on the real JAX engine.

Invariant: a continuation that reuses its kept pages and prefills only the new tokens samples
the same tokens with the same log-probs as one that re-prefills prompt + response in full.
"""
import dataclasses

import numpy as np
import pytest

from rollout import engine as E
from rollout.jax_engine import JaxEngine
from tests.rollout.rollout_fixtures import JAX_ENGINE_KW as ENGINE
from tests.rollout.rollout_fixtures import hf_tensors, prompt

TOOL_TOKENS = np.array([3, 1, 4, 1, 5, 9, 2], np.int64)  # stands for a tool's output (loss mask 0)


@pytest.fixture(scope="module")
def engine(checkpoint_dirs):
    return JaxEngine.from_pretrained(checkpoint_dirs[0], **ENGINE)


def _first_turn(engine, rid, seed, keep, temperature=1.0):
    """A first turn that ends at a stop token: the stop is a token the free run samples at
    position >= 2 that it had not sampled before (same seed, so the turn stops exactly there)."""
    toks = prompt(seed, 9 + seed)
    free = E.run_to_completion(engine, [E.Request(f"free{rid}", toks, E.SamplingParams(
        temperature=temperature, max_new_tokens=12, seed=seed))])[f"free{rid}"].response_tokens.tolist()
    j = next(j for j in range(2, len(free)) if free[j] not in free[:j])
    sp = E.SamplingParams(temperature=temperature, max_new_tokens=40, seed=seed, stop_token_ids=(free[j],))
    c = E.run_to_completion(engine, [E.Request(rid, toks, sp, keep_kv=keep)])[rid]
    assert c.finish_reason == "stop" and len(c.response_tokens) == j + 1
    return c, sp


def _continuation(c, sp, keep, tool=TOOL_TOKENS):
    prefix = np.concatenate([c.response_tokens, tool])
    z = np.zeros(len(tool), np.float32)
    return E.Request(c.request_id, c.prompt_tokens, dataclasses.replace(sp, stop_token_ids=()), c.group_id,
                     prefix, np.concatenate([c.logp, z]), np.concatenate([c.raw_logp, z]),
                     np.concatenate([c.versions, np.full(len(tool), c.weight_version)]), keep_kv=keep)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_kept_continuation_prefills_only_the_new_tokens_and_equals_a_full_prefill(engine, temperature):
    got = {}
    for keep in (True, False):
        c, sp = _first_turn(engine, f"t{keep}", 3, keep, temperature)
        before = (engine.num_prefill_tokens, engine.num_cached_tokens)
        cont = _continuation(c, sp, keep)
        got[keep] = E.run_to_completion(engine, [cont])[cont.id]
        context = len(c.prompt_tokens) + len(c.response_tokens) + len(TOOL_TOKENS)
        cached = len(c.prompt_tokens) + len(c.response_tokens) - 1 if keep else 0  # the stop token was never fed
        assert got[keep].num_cached_tokens == cached
        assert (engine.num_prefill_tokens - before[0], engine.num_cached_tokens - before[1]) == (context - cached, cached)
        assert engine.stats().kv_used_tokens == 0, "the continuation's pages were not given back"
    assert got[True].response_tokens.tolist() == got[False].response_tokens.tolist()
    np.testing.assert_allclose(got[True].raw_logp, got[False].raw_logp, atol=1e-4)
    np.testing.assert_allclose(got[True].logp, got[False].logp, atol=1e-4)


def test_kept_pages_are_given_back_by_abort_and_before_any_preemption(engine):
    c, sp = _first_turn(engine, "k", 4, keep=True)
    assert engine.stats().kv_used_tokens > 0, "a stopped keep_kv request kept nothing"
    assert engine.abort(["k"]) == [] and engine.stats().kv_used_tokens == 0
    c, sp = _first_turn(engine, "k", 4, keep=True)
    # Four requests of 4 pages each need the whole pool: the kept page goes first, and nobody is
    # preempted or kept waiting for it.
    pages = engine.num_pages // 4
    engine.add([E.Request(f"p{i}", prompt(i, pages * engine.page_size - 8), E.SamplingParams(max_new_tokens=4, seed=i))
                for i in range(4)])
    engine.step()
    assert engine.stats().num_running == 4 and engine.num_preemptions == 0
    E.run_to_completion(engine)
    assert engine.num_preemptions == 0 and engine.stats().kv_used_tokens == 0
    cont = E.run_to_completion(engine, [_continuation(c, sp, keep=True)])["k"]
    assert cont.num_cached_tokens == 0  # evicted: prefilled in full, the same result as never kept
    c2, sp2 = _first_turn(engine, "k2", 4, keep=False)
    ref = E.run_to_completion(engine, [_continuation(c2, sp2, keep=False)])["k2"]
    assert cont.response_tokens.tolist() == ref.response_tokens.tolist()


def test_a_continuation_whose_cached_context_changed_is_prefilled_in_full(engine):
    c, sp = _first_turn(engine, "x", 5, keep=True)
    edited = dataclasses.replace(c, response_tokens=np.concatenate([[(c.response_tokens[0] + 1) % 512],
                                                                    c.response_tokens[1:]]))
    cont = E.run_to_completion(engine, [_continuation(edited, sp, keep=True)])["x"]
    assert cont.num_cached_tokens == 0 and engine.stats().kv_used_tokens == 0


def test_kept_pages_serve_a_continuation_across_a_weight_switch_outside_exact_mode(engine, checkpoint_dirs):
    c, sp = _first_turn(engine, "w", 6, keep=True)
    engine.load_weights(hf_tensors(checkpoint_dirs[0]), version=engine.weight_version + 1)
    cont = E.run_to_completion(engine, [_continuation(c, sp, keep=True)])["w"]
    # Like a running request across a switch: its cached K/V stay as computed.
    assert cont.num_cached_tokens == len(c.prompt_tokens) + len(c.response_tokens) - 1


@pytest.mark.slow  # an exact-mode engine and the learner's log-probs compile here
def test_exact_mode_reuses_kept_pages_on_their_own_version_only_and_stays_bit_identical():
    """Zero-mismatch mode: a kept continuation's tokens equal the learner's recompute bit for bit;
    after a weight switch the kept K/V are stale, so the continuation is prefilled in full."""
    import jax
    from flax import nnx

    from laminar_jax.learner import logprobs as lp
    from laminar_jax.models.config import DecoderConfig
    from laminar_jax.models.decoder import Decoder
    from laminar_jax.models.hf import params_to_hf

    # the shapes of tests/rollout/test_jax_zero_mismatch.py (fp32), so the session compiles them once
    cfg = DecoderConfig.preset("tiny", param_dtype="float32", dtype="float32", attention="exact")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    params = jax.tree.map(np.asarray, nnx.state(model, nnx.Param).to_pure_dict())
    eng = JaxEngine(cfg, params, max_num_seqs=4, max_model_len=48, page_size=8, min_rows=4, min_window_pages=6)
    c, sp = _first_turn(eng, "e", 2, keep=True)
    cont = E.run_to_completion(eng, [_continuation(c, sp, keep=True)])["e"]
    assert cont.num_cached_tokens == len(c.prompt_tokens) + len(c.response_tokens) - 1
    n = len(cont.prompt_tokens) + len(cont.response_tokens)
    tok = np.zeros((1, 48), np.int32)
    tok[0, :n] = np.concatenate([cont.prompt_tokens, cont.response_tokens])
    seg, pos, resp = (tok * 0 for _ in range(3))
    seg[0, :n], pos[0, :n], resp[0, len(cont.prompt_tokens):n] = 1, np.arange(n), 1
    learner, _ = jax.jit(lambda t, p, s, r: lp.sequence_logprobs(model, t, p, s, response_mask=r))(tok, pos, seg, resp)
    new = slice(len(c.response_tokens) + len(TOOL_TOKENS), None)  # the tokens decoded after the kept prefix
    learner = np.asarray(learner)[0, len(cont.prompt_tokens):n]
    assert np.array_equal(cont.raw_logp[new], learner[new])

    c, sp = _first_turn(eng, "s", 2, keep=True)
    eng.load_weights(params_to_hf(cfg, params), version=1)
    assert E.run_to_completion(eng, [_continuation(c, sp, keep=True)])["s"].num_cached_tokens == 0
