"""rollout.engine records: validation with clear messages, normalisation, resume requests."""
import numpy as np
import pytest

from rollout import engine as E


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-0.1), "temperature: got -0.1"),
    (dict(temperature=float("nan")), "temperature: got nan"),
    (dict(top_p=0.0), "top_p: got 0.0"),
    (dict(top_p=1.5), "top_p: got 1.5"),
    (dict(top_k=-1), "top_k: got -1"),
    (dict(max_new_tokens=0), "max_new_tokens: got 0"),
    (dict(seed=2**32), "seed: got 4294967296"),
])
def test_sampling_params_reject_out_of_range_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        E.SamplingParams(**kwargs)


def test_request_normalises_tokens_and_checks_prefix_lengths():
    r = E.Request("a", [1, 2, 3], prefix_tokens=[4, 5], prefix_logp=[-1.0, -2.0])
    assert r.prompt_tokens.dtype == np.int64 and r.prompt_tokens.tolist() == [1, 2, 3]
    np.testing.assert_array_equal(r.prefix_raw_logp, [-1.0, -2.0])  # defaults to the given logp
    assert r.prefix_versions.tolist() == [-1, -1] and r.remaining_new_tokens == 254
    with pytest.raises(ValueError, match="prefix_logp: expected 2 values"):
        E.Request("b", [1], prefix_tokens=[4, 5], prefix_logp=[-1.0])
    with pytest.raises(ValueError, match="prompt_tokens: expected a 1-D sequence of ints"):
        E.Request("c", [[1, 2]])
    with pytest.raises(ValueError, match="prompt_tokens: expected a 1-D sequence of ints"):
        E.Request("d", [1.5, 2.0])
    with pytest.raises(ValueError, match="Request.id"):
        E.Request("", [1])


def test_validate_request_names_the_request_and_the_problem():
    ok = dict(vocab_size=10, max_model_len=8)
    E.validate_request(E.Request("a", [1, 2]), **ok)
    cases = [
        (E.Request("b", [1, 10]), "request 'b': prompt_tokens\\[1\\] = 10 is outside the vocabulary \\[0, 10\\)"),
        (E.Request("c", [1], prefix_tokens=[-3]), "request 'c': prefix_tokens\\[0\\] = -3"),
        (E.Request("d", [1], E.SamplingParams(stop_token_ids=(12,))), "request 'd': stop token 12"),
        (E.Request("e", list(range(5)), prefix_tokens=[1, 2, 3]), "= 8 tokens leaves no room"),
        (E.Request("f", [1], E.SamplingParams(max_new_tokens=2), prefix_tokens=[3, 4]),
         "already reaches max_new_tokens=2"),
        (E.Request("g", []), "request 'g': empty prompt"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            E.validate_request(request, **ok)
    with pytest.raises(ValueError, match="id already in use"):
        E.validate_request(E.Request("a", [1]), known_ids={"a"}, **ok)


def test_partial_resumes_as_a_request_carrying_its_prefix():
    sp = E.SamplingParams(temperature=0.5, max_new_tokens=9, seed=3)
    p = E.Partial("r", "g", np.array([1, 2]), np.array([7, 8]), np.array([-0.5, -0.25], np.float32),
                  np.array([-0.7, -0.3], np.float32), np.array([4, 4]), sp, 4)
    r = p.to_request()
    assert (r.id, r.group_id, r.sampling) == ("r", "g", sp)
    assert r.prefix_tokens.tolist() == [7, 8] and r.prefix_versions.tolist() == [4, 4]
    np.testing.assert_array_equal(r.prefix_raw_logp, p.raw_logp)
    assert r.remaining_new_tokens == 7
