"""Staleness cap, decay weight and histogram."""
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.rl.seq_ops import seq_view
from laminar_jax.rl.staleness import (staleness_decay_weights, staleness_histogram, staleness_keep,
                                      staleness_per_token)

MASK = jnp.asarray([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]], jnp.float32)


def test_per_sequence_staleness_is_broadcast_and_padding_zeroed():
    k = staleness_per_token(jnp.asarray([0, 1, 5, 99, 2]), MASK)
    np.testing.assert_array_equal(k, [[0, 0, 0], [1, 0, 0], [5, 5, 5], [0, 0, 0], [2, 0, 0]])
    assert float(jnp.sum(staleness_per_token(None, MASK))) == 0.0
    with pytest.raises(ValueError, match=r"staleness has shape \(4,\)"):
        staleness_per_token(jnp.zeros(4), MASK)


def test_cap_and_decay():
    k = staleness_per_token(jnp.asarray([0, 1, 5, 99, 2]), MASK)
    np.testing.assert_array_equal(staleness_keep(k, MASK, max_staleness=2)[:, 0], [1, 1, 0, 1, 1])
    np.testing.assert_allclose(staleness_decay_weights(k, MASK, decay=0.5)[:, 0],
                               [1, 0.5, 0.5 ** 5, 1, 0.25])


def test_histogram_counts_valid_sequences_with_an_open_last_bin():
    k = staleness_per_token(jnp.asarray([[0, 3, 0], [1, 0, 0], [5, 5, 5], [7, 7, 7], [2, 0, 0]]),
                            MASK)
    hist, mean, mx = staleness_histogram(k, MASK, seq_view(MASK), bins=4)
    # head staleness per sequence: 3, 1, 5, (padding row), 2 -> bins 3, 1, 3, 2
    np.testing.assert_array_equal(hist, [0, 1, 1, 2])
    np.testing.assert_allclose(mean, (3 + 1 + 5 + 2) / 4)
    assert float(mx) == 5.0
