"""Closed forms for rl.mismatch: values checked by hand on a 2x3 batch."""
import math

import numpy as np
import pytest

from laminar_jax.rl.mismatch import MISMATCH_KEYS, mismatch_metrics


def test_hand_computed_values():
    behaviour = np.array([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]], np.float32)
    learner = np.array([[-1.5, -2.0, -0.25], [-0.1, -1.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 0, 0]], np.float32)
    m = {k: float(v) for k, v in mismatch_metrics(learner, behaviour, mask).items()}
    d = [-0.5, 0.0, 0.25, 0.0]  # learner - behaviour on the 4 valid tokens; token (1,1) is masked
    assert m["num_tokens"] == 4
    assert m["abs_mean"] == pytest.approx(sum(abs(x) for x in d) / 4)
    assert m["abs_max"] == pytest.approx(0.5)
    assert m["k1"] == pytest.approx(-sum(d) / 4)
    assert m["k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4, rel=1e-6)
    assert m["chi2"] == pytest.approx(sum((math.exp(x) - 1) ** 2 for x in d) / 4, rel=1e-6)


def test_equal_policies_give_zero_and_keys_are_fixed():
    logp = np.log(np.full((3, 4), 0.3, np.float32))
    m = mismatch_metrics(logp, logp, np.ones((3, 4)))
    assert tuple(m) == MISMATCH_KEYS
    assert all(float(m[k]) == 0.0 for k in MISMATCH_KEYS if k != "num_tokens")
    empty = mismatch_metrics(logp, logp - 1.0, np.zeros((3, 4)))
    assert all(float(v) == 0.0 for v in empty.values())


def test_stale_ratio_is_clamped_not_inf():
    m = mismatch_metrics(np.zeros((1, 2)), np.full((1, 2), -90.0), np.ones((1, 2)))
    assert all(np.isfinite(float(v)) for v in m.values())
    assert float(m["abs_max"]) == 20.0
