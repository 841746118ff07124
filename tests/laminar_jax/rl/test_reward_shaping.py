"""DAPO overlong shaping, dynamic-sampling filter and group statistics."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.rl import reward_shaping as RS


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_overlong_piecewise_boundaries(factor):
    # max_len 20, buffer 4: 0 up to 16 tokens, ramp to -factor at 20, floor -factor beyond.
    lengths = jnp.array([0, 16, 17, 18, 19, 20, 21, 100])
    pen, _ = RS.overlong_penalty(lengths, max_len=20, buffer=4, penalty_factor=factor)
    want = factor * np.array([0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    np.testing.assert_allclose(pen, want, rtol=1e-6)


def test_overlong_differs_from_verl_only_beyond_max_len():
    lengths = np.arange(0, 31)
    pen, _ = RS.overlong_penalty(jnp.asarray(lengths), max_len=20, buffer=4)
    verl = np.minimum(-(lengths - 16) / 4, 0.0)  # verl: no floor at -1
    inside = lengths <= 20
    np.testing.assert_allclose(np.asarray(pen)[inside], verl[inside], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(pen)[~inside], -1.0)
    assert np.all(verl[~inside] < -1.0)


def test_overlong_zero_and_full_buffer():
    # buffer 0 is a step at max_len.
    pen, _ = RS.overlong_penalty(jnp.array([19, 20, 21]), max_len=20, buffer=0,
                                 penalty_factor=2.0)
    np.testing.assert_allclose(pen, [0.0, 0.0, -2.0])
    # buffer == max_len: the ramp starts at length 0.
    pen, _ = RS.overlong_penalty(jnp.array([0, 1, 10, 20, 25]), max_len=20, buffer=20)
    np.testing.assert_allclose(pen, [0.0, -0.05, -0.5, -1.0, -1.0], rtol=1e-6)


def test_overlong_metrics_ignore_invalid_rows():
    pen, m = RS.overlong_penalty(jnp.array([5, 18, 30, 30]), jnp.array([True, True, True, False]),
                                 max_len=20, buffer=4)
    np.testing.assert_allclose(pen, [0.0, -0.5, -1.0, 0.0])
    np.testing.assert_allclose(m["overlong_frac"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["overlong_penalty_mean"], -0.5, rtol=1e-6)


@pytest.mark.parametrize("kw, field", [(dict(max_len=0, buffer=0), "max_len"),
                                       (dict(max_len=10, buffer=11), "buffer"),
                                       (dict(max_len=10, buffer=-1), "buffer"),
                                       (dict(max_len=10, buffer=2, penalty_factor=-1.0),
                                        "penalty_factor")])
def test_overlong_bad_arguments(kw, field):
    with pytest.raises(ValueError, match=f"overlong_penalty: {field}"):
        RS.overlong_penalty(jnp.array([1, 2]), **kw)


def test_dynamic_filter_groups():
    # Group 3: [1, 1] constant (a padding row with reward 0 must not make it vary) -> dropped.
    # Group 0: [0, 1, 1] -> kept. Group 6: singleton -> dropped. Group 4: [0.5, 0.5 + 1e-3].
    r = jnp.array([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.2, 0.5, 0.501])
    g = jnp.array([3, 0, 0, 3, 0, 3, 6, 4, 4])
    v = jnp.array([True, True, True, True, True, False, True, True, True])
    (keep, keep_group), m = RS.dynamic_sampling_filter(r, g, v, num_groups=8)
    np.testing.assert_array_equal(keep, [False, True, True, False, True, False, False, True, True])
    np.testing.assert_array_equal(keep_group, [True, False, False, False, True, False, False,
                                               False])
    np.testing.assert_allclose(m["kept_seq_frac"], 5 / 8)
    np.testing.assert_allclose(m["kept_group_frac"], 2 / 4)
    np.testing.assert_array_equal(m["num_groups_present"], 4)
    # A spread at or below tol counts as constant.
    (keep, _), _ = RS.dynamic_sampling_filter(r, g, v, num_groups=8, tol=1e-2)
    np.testing.assert_array_equal(keep[7:], [False, False])
    # jit gives the same mask.
    (jkeep, _), _ = jax.jit(lambda r, g, v: RS.dynamic_sampling_filter(r, g, v, num_groups=8))(
        r, g, v)
    (keep, _), _ = RS.dynamic_sampling_filter(r, g, v, num_groups=8)
    np.testing.assert_array_equal(jkeep, keep)


@pytest.mark.parametrize("seed", [0, 1])
def test_group_moments_match_numpy(seed):
    rng = np.random.default_rng(seed)
    r = rng.normal(size=20).astype(np.float32)
    g = rng.integers(0, 6, 20).astype(np.int32)
    v = rng.random(20) < 0.8
    r[~v] = np.nan
    count, mean, std = RS.group_moments(r, g, v, num_groups=7)
    for gid in range(7):
        x = r[v & (g == gid)]
        assert count[gid] == len(x)
        np.testing.assert_allclose(mean[gid], x.mean() if len(x) else 0.0, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(std[gid], x.std(ddof=1) if len(x) > 1 else 0.0, rtol=1e-5,
                                   atol=1e-6)


def test_check_group_inputs_messages():
    r = jnp.zeros(3)
    with pytest.raises(ValueError, match=r"where: group_ids\[2\] = -1 is outside"):
        RS.check_group_inputs("where", rewards=r, group_ids=jnp.array([0, 1, -1]),
                              valid=jnp.ones(3, bool), num_groups=2)
    # The same id on a padding row is fine.
    RS.check_group_inputs("where", rewards=r, group_ids=jnp.array([0, 1, -1]),
                          valid=jnp.array([True, True, False]), num_groups=2)
    with pytest.raises(ValueError, match="where: group_ids must be an int"):
        RS.check_group_inputs("where", rewards=r, group_ids=jnp.zeros(3),
                              valid=jnp.ones(3, bool), num_groups=2)
    with pytest.raises(ValueError, match="where: rewards must be"):
        RS.check_group_inputs("where", rewards=jnp.zeros((3, 1)), group_ids=jnp.zeros(3, int),
                              valid=jnp.ones(3, bool), num_groups=2)
