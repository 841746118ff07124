"""JAX-engine specifics: compiled shapes, KV-budget admission and preemption, exact seeded resume."""
import numpy as np
import pytest

from rollout import engine as E
from rollout.jax_engine import JaxEngine
from tests.rollout.rollout_fixtures import JAX_ENGINE_KW as ENGINE
from tests.rollout.rollout_fixtures import hf_tensors, prompt


def _sampled(rid, toks, n, seed, temperature=1.0, **kw):
    return E.Request(rid, toks, E.SamplingParams(temperature=temperature, max_new_tokens=n, seed=seed, **kw))


def _workload(tag):
    return [_sampled(f"{tag}{i}", prompt(i, 5 + 7 * i), 20 + 9 * i, seed=i, top_p=0.9) for i in range(5)]


def _drive(engine, requests, add_at=(0, 2, 4, 6, 8)):
    """Add request i at step add_at[i]; step until done; completions by id and per-step stats."""
    done, stats = {}, []
    for step in range(10_000):
        engine.add([r for r, at in zip(requests, add_at) if at == step])
        if step > max(add_at) and not engine.has_unfinished():
            return done, stats
        done.update((c.request_id, c) for c in engine.step())
        stats.append(engine.stats())
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module")
def roomy(checkpoint_dirs):
    return JaxEngine.from_pretrained(checkpoint_dirs[0], **ENGINE)


def test_steady_state_runs_without_recompiling(roomy, checkpoint_dirs):
    _drive(roomy, _workload("warm"))
    sizes = (roomy._decode_fn._cache_size(), roomy._prefill_fn._cache_size())
    # Bounded by the buckets: rows {4} x window pages {2, 4}.
    assert sizes[0] <= 2 and sizes[1] <= 2
    _drive(roomy, _workload("again"))
    roomy.load_weights(hf_tensors(checkpoint_dirs[1]), version=1)
    _drive(roomy, _workload("new_weights"))
    roomy.load_weights(hf_tensors(checkpoint_dirs[0]), version=2)
    assert (roomy._decode_fn._cache_size(), roomy._prefill_fn._cache_size()) == sizes


def test_kv_budget_limits_admission_and_preemption_keeps_results(roomy, checkpoint_dirs):
    reqs = _workload("kv")
    expected, _ = _drive(roomy, reqs)
    # 5 pages of 32 tokens: one full-length request fits, the five together do not.
    tight = JaxEngine.from_pretrained(checkpoint_dirs[0], **dict(ENGINE, num_pages=5))
    got, stats = _drive(tight, reqs)
    assert any(s.num_waiting > 0 and s.num_running < 4 for s in stats), "KV budget never held a request back"
    assert tight.num_preemptions > 0
    assert max(s.kv_used for s in stats) == 1.0 and stats[-1].kv_used == 0.0
    for r in reqs:
        assert got[r.id].response_tokens.tolist() == expected[r.id].response_tokens.tolist(), r.id
        np.testing.assert_allclose(got[r.id].logp, expected[r.id].logp, atol=1e-4)


def test_admission_waits_for_pages_of_the_whole_prompt(checkpoint_dirs):
    eng = JaxEngine.from_pretrained(checkpoint_dirs[0], **dict(ENGINE, num_pages=5))
    eng.add([_sampled(f"a{i}", prompt(i, 40), 4, seed=i) for i in range(3)])  # 2 pages each
    eng.step()
    s = eng.stats()
    assert (s.num_running, s.num_waiting, s.kv_used_tokens) == (2, 1, 4 * 32)
    E.run_to_completion(eng)
    assert eng.stats().kv_used_tokens == 0


def test_seeded_sampling_resumes_exactly_after_an_abort(roomy):
    req = _sampled("r", prompt(9, 11), 30, seed=5, top_k=40, temperature=0.8)
    whole = E.run_to_completion(roomy, [req])["r"]
    roomy.add([req])
    for _ in range(9):
        roomy.step()
    (partial,) = roomy.abort(["r"])
    resumed = E.run_to_completion(roomy, [partial.to_request()])["r"]
    assert resumed.response_tokens.tolist() == whole.response_tokens.tolist()
    np.testing.assert_allclose(resumed.raw_logp, whole.raw_logp, atol=1e-4)


def test_a_request_needing_more_than_the_whole_kv_pool_is_refused(checkpoint_dirs):
    with pytest.raises(ValueError, match="num_pages=3 cannot hold one request"):
        JaxEngine.from_pretrained(checkpoint_dirs[0], **dict(ENGINE, num_pages=3))


def test_decode_windows_cover_each_requests_reach_from_its_first_token(checkpoint_dirs):
    """Page 32, max_model_len 128: a request reaching 25 tokens decodes in a 1-page window, one
    reaching 105 in the 4-page window from its first token on (never 1 -> 2 -> 4 pages as it
    grows), and the tokens are those of an engine whose every window is the full length."""
    eng = JaxEngine.from_pretrained(checkpoint_dirs[0], **dict(ENGINE, min_window_pages=1))
    windows = []
    decode = eng._decode_fn

    def recording(params, k, v, tokens, lengths, rows, *rest):
        windows.append(rows.shape[1])
        return decode(params, k, v, tokens, lengths, rows, *rest)

    eng._decode_fn = recording
    short = _sampled("short", prompt(3, 5), 20, seed=3)
    long = _sampled("long", prompt(4, 5), 100, seed=4)
    got = E.run_to_completion(eng, [short])
    assert set(windows) == {1} and len(windows) == len(got["short"].response_tokens) - 1
    windows.clear()
    got.update(E.run_to_completion(eng, [long]))
    assert set(windows) == {4}, windows
    full = JaxEngine.from_pretrained(checkpoint_dirs[0], **dict(ENGINE, min_window_pages=4))
    for req in (short, long):
        want = E.run_to_completion(full, [req])[req.id]
        assert got[req.id].response_tokens.tolist() == want.response_tokens.tolist(), req.id
        np.testing.assert_allclose(got[req.id].raw_logp, want.raw_logp, atol=1e-4)
