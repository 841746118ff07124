"""rollout.jax_sampling against a numpy reference of temperature / top-k / top-p sampling."""
import jax
import numpy as np
import pytest

from rollout.jax_sampling import sample
from tests.rollout.rollout_fixtures import truncated_logp

V = 12
_sample = jax.jit(sample)


def _logits(rows, seed=0):
    return np.random.RandomState(seed).normal(0, 2.0, (rows, V)).astype(np.float32)


def _call(logits, temperature, top_k, top_p, seeds, counters):
    s = logits.shape[0]
    full = lambda x, dt: np.broadcast_to(np.asarray(x, dt), (s,)).copy()  # noqa: E731
    out = _sample(logits, full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
                  full(seeds, np.uint32), full(counters, np.int32))
    return [np.asarray(x) for x in out]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.8), (1.3, 4, 1.0), (0.9, 5, 0.6)])
def test_logps_match_the_reference_and_tokens_stay_in_the_kept_set(temperature, top_k, top_p):
    logits = _logits(64)
    tokens, logp, raw = _call(logits, temperature, top_k, top_p, np.arange(64), 3)
    ref_raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(raw, ref_raw[np.arange(64), tokens], atol=1e-5)
    ref = [truncated_logp(z.astype(np.float64), y, temperature, top_k, top_p) for z, y in zip(logits, tokens)]
    assert np.all(np.isfinite(ref)), "a token outside the top-k / top-p set was sampled"
    np.testing.assert_allclose(logp, ref, atol=1e-5)
    if (temperature, top_k, top_p) == (1.0, 0, 1.0):
        np.testing.assert_array_equal(logp, raw)


def test_greedy_rows_take_the_argmax_and_report_raw_logp_in_both_fields():
    logits = _logits(8, seed=1)
    tokens, logp, raw = _call(logits, 0.0, 3, 0.5, np.arange(8), 0)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    np.testing.assert_array_equal(logp, raw)


def test_empirical_frequencies_follow_the_truncated_distribution():
    # One row of logits, 4000 draws with different counters: frequencies ~ q within 4 sigma.
    z = _logits(1, seed=2)[0]
    n = 4000
    tokens, _, _ = _call(np.tile(z, (n, 1)), 0.8, 0, 0.9, 7, np.arange(n))
    q = np.exp([truncated_logp(z.astype(np.float64), y, 0.8, 0, 0.9) for y in range(V)])
    freq = np.bincount(tokens, minlength=V) / n
    assert np.all(freq[q == 0] == 0)
    np.testing.assert_array_less(np.abs(freq - q), 4 * np.sqrt(q * (1 - q) / n) + 1e-9)


def test_a_row_draws_the_same_token_alone_or_in_a_batch():
    logits = _logits(5, seed=3)
    seeds, counters = np.array([11, 12, 13, 14, 15]), np.array([0, 5, 9, 2, 1])
    batch, _, _ = _call(logits, 1.0, 0, 1.0, seeds, counters)
    for i in range(5):
        alone, _, _ = _call(logits[i:i + 1], 1.0, 0, 1.0, seeds[i], counters[i])
        assert alone[0] == batch[i]
    # Changing the seed or the counter changes the stream (over 64 rows, some tokens differ).
    many = np.tile(logits[:1], (64, 1))
    a, _, _ = _call(many, 1.0, 0, 1.0, 1, np.arange(64))
    b, _, _ = _call(many, 1.0, 0, 1.0, 2, np.arange(64))
    assert (a != b).any() and len(set(a.tolist())) > 1
