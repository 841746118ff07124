"""Loss metrics: closed forms and ESS."""
import math

import jax.numpy as jnp
import numpy as np

from laminar_jax.rl.metrics import METRIC_KEYS, effective_sample_size, loss_metrics
from laminar_jax.rl.seq_ops import seq_view


def test_metrics_closed_form():
    mask = jnp.asarray([[1, 1, 0], [1, 1, 1]], jnp.float32)
    learner = jnp.asarray([[-1.0, -1.0, 1e30], [-1.0, -1.0, -1.0]])
    old = learner + jnp.asarray([[0.1, 0.0, 0.0], [0.0, 0.0, -0.2]])
    behaviour = learner + jnp.asarray([[0.3, -0.1, jnp.nan], [0.2, 0.0, 0.0]])
    weight = jnp.asarray([[1.0, 2.0, 9.0], [0.5, 1.0, 1.0]])
    keep = jnp.asarray([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    z = jnp.zeros((2, 3))
    clip_aux = {"clipped_low": z, "clipped_dual": z,
                "clipped_high": jnp.asarray([[1.0, 0, 0], [0, 1.0, 0]])}
    k = jnp.asarray([[1.0, 1.0, 0.0], [3.0, 3.0, 3.0]])
    m = loss_metrics(mask=mask, keep=keep, weight=weight, is_weight_raw=weight * 2,
                     learner_logp=learner, old_logp=old, behaviour_logp=behaviour,
                     clip_aux=clip_aux, staleness=k, view=seq_view(mask), staleness_bins=3)
    assert set(m) | {"loss", "pg_loss", "kl_loss", "kl_ref", "entropy"} == set(METRIC_KEYS)
    # k3 = r - 1 - log r with r = pi / pi_old, log r = learner - old = -0.1 and 0.2 here
    # (the former 1/r - 1 + log r gives k3(0.1) + k3(-0.2), 3.4e-3 instead of 2.7e-2 / 5 ...)
    k3 = lambda x: math.exp(x) - x - 1
    expect = {
        "approx_kl": (k3(-0.1) + k3(0.2)) / 5,
        "clip_frac_high": 1 / 4, "clip_frac_low": 0.0, "clip_frac_dual": 0.0,
        "is_weight_mean": 5.5 / 5, "is_weight_min": 0.5, "is_weight_max": 2.0,
        "is_weight_raw_max": 4.0,
        "ess": 4.5 ** 2 / (5 * 6.25),
        "masked_frac": 1 / 5, "masked_seq_frac": 1 / 2,
        "mismatch_abs_mean": 0.6 / 5, "mismatch_abs_max": 0.3,
        "ppl_ratio": (math.exp(0.1) + math.exp(0.2 / 3)) / 2,
        "staleness_mean": 2.0, "staleness_max": 3.0,
        "num_tokens": 5, "num_kept_tokens": 4, "num_seqs": 2,
    }
    for key, value in expect.items():
        np.testing.assert_allclose(m[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    np.testing.assert_array_equal(m["staleness_hist"], [0, 1, 1])


def test_effective_sample_size():
    mask = jnp.ones((1, 4))
    np.testing.assert_allclose(effective_sample_size(jnp.full((1, 4), 3.0), mask), 1.0)
    # one weight carries everything: ESS = 1 / N
    np.testing.assert_allclose(effective_sample_size(jnp.asarray([[0.0, 0, 5, 0]]), mask), 0.25)
    np.testing.assert_allclose(effective_sample_size(jnp.zeros((1, 4)), mask), 0.0)
    np.testing.assert_allclose(effective_sample_size(jnp.ones((1, 4)), jnp.zeros((1, 4))), 0.0)
