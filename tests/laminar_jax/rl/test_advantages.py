"""Advantage estimators: hand-computed closed forms, reference loops and invariants."""
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.rl import advantages as A
from laminar_jax.rl.spec import AdvantageSpec

# Groups of size 3, 1 and 2 with non-contiguous ids, plus a padding row with a NaN reward and an
# out-of-range id: group 5 = [1, 0, 1], group 2 = [0.5] (singleton), group 7 = [2, 3].
R = jnp.array([1.0, 0.0, 0.5, 2.0, 1.0, 3.0, jnp.nan])
G = jnp.array([5, 5, 2, 7, 5, 7, -4], jnp.int32)
V = jnp.array([True, True, True, True, True, True, False])
NG = 8
S5 = 1 / np.sqrt(3)  # unbiased std of [1, 0, 1]
S7 = np.sqrt(0.5)  # unbiased std of [2, 3]


def test_grpo_closed_form_unequal_groups_and_singleton():
    eps = 1e-6
    adv, m = A.grpo_advantages(R, G, V, num_groups=NG, eps=eps)
    want = [(1 / 3) / (S5 + eps), (-2 / 3) / (S5 + eps), 0.5 / (1 + eps), -0.5 / (S7 + eps),
            (1 / 3) / (S5 + eps), 0.5 / (S7 + eps), 0.0]
    np.testing.assert_allclose(adv, want, rtol=1e-5)
    # eps enters as std + eps (singleton: std 1 and mean 0, as verl).
    adv, _ = A.grpo_advantages(R, G, V, num_groups=NG, eps=0.1)
    np.testing.assert_allclose(np.asarray(adv)[[2, 3]], [0.5 / 1.1, -0.5 / (S7 + 0.1)], rtol=1e-5)
    # Three non-empty groups; only the singleton has zero spread.
    np.testing.assert_allclose(m["zero_std_group_frac"], 1 / 3, rtol=1e-6)


def test_grpo_constant_group_is_zero():
    adv, m = A.grpo_advantages(jnp.array([1.0, 1.0, 0.0, 1.0]), jnp.array([0, 0, 1, 1]),
                               jnp.ones(4, bool), num_groups=2)
    s = np.sqrt(0.5) + 1e-6
    np.testing.assert_allclose(adv, [0.0, 0.0, -0.5 / s, 0.5 / s], rtol=1e-5)
    np.testing.assert_allclose(m["zero_std_group_frac"], 0.5)


def test_dr_grpo_closed_form():
    adv, _ = A.dr_grpo_advantages(R, G, V, num_groups=NG)
    np.testing.assert_allclose(adv, [1 / 3, -2 / 3, 0.5, -0.5, 1 / 3, 0.5, 0.0], rtol=1e-5)


def test_rloo_closed_form_singleton_is_zero():
    adv, m = A.rloo_advantages(R, G, V, num_groups=NG)
    # Group 5: 1 - (0 + 1)/2, 0 - (1 + 1)/2; group 7: 2 - 3, 3 - 2; singleton: 0 (documented).
    np.testing.assert_allclose(adv, [0.5, -1.0, 0.0, -1.0, 0.5, 1.0, 0.0], rtol=1e-5)
    np.testing.assert_allclose(m["singleton_group_frac"], 1 / 3, rtol=1e-6)


def test_discounted_returns_kl_and_mask_hole():
    # r = R [t = last] - kl_coef * kl = [-0.05, -0.1, 1.8, (masked)], gamma = 0.5.
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 1, 0]], bool)
    kl = jnp.array([[0.1, 0.2, 0.4, 9.0], [0.0, 5.0, 0.0, 9.0]])
    tok = A.place_at_last_token(jnp.array([2.0, 1.0]), mask) - 0.5 * jnp.where(mask, kl, 0.0)
    ret = A.discounted_returns(tok, mask, gamma=0.5)
    # Row 2: the masked token at t=1 is skipped (no reward, no discount): 0.5 * 1 at t=0.
    np.testing.assert_allclose(ret, [[0.35, 0.8, 1.8, 0.0], [0.5, 0.0, 1.0, 0.0]], rtol=1e-6)
    adv, m = A.reinforce_pp_advantages(jnp.array([2.0, 1.0]), mask, gamma=0.5, kl=kl, kl_coef=0.5)
    vals = np.array([0.35, 0.8, 1.8, 0.5, 1.0])
    want = (vals - vals.mean()) / np.sqrt(vals.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(adv[mask], want, rtol=1e-5)
    np.testing.assert_array_equal(adv[~mask], 0.0)
    np.testing.assert_allclose(m["return_mean"], vals.mean(), rtol=1e-6)


def test_reinforce_pp_gamma_one_closed_form():
    # Every token's return is R: tokens [1, 1 | 0, 0, 0], mean 0.4, unbiased var 0.3.
    mask = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
    adv, m = A.reinforce_pp_advantages(jnp.array([1.0, 0.0]), mask)
    s = np.sqrt(0.3 + 1e-8)
    np.testing.assert_allclose(adv, [[0.6 / s, 0.6 / s, 0.0], [-0.4 / s] * 3], rtol=1e-5)
    # the logged spread is the one the whitening divides by (unbiased, not population 0.24)
    np.testing.assert_allclose(m["return_std"], np.sqrt(0.3), rtol=1e-6)
    np.testing.assert_allclose(adv[0, 0], 0.6 / np.sqrt(float(m["return_std"]) ** 2 + 1e-8),
                               rtol=1e-6)


def test_reinforce_pp_baseline_closed_form():
    # Group 0 = [1, 0] (mean 0.5), group 1 = [5] singleton (mean 0, as verl); lengths 1, 2, 1.
    mask = jnp.array([[1, 0], [1, 1], [1, 0], [1, 1]], bool)
    adv, _ = A.reinforce_pp_baseline_advantages(
        jnp.array([1.0, 0.0, 5.0, 4.0]), jnp.array([0, 0, 1, 3]),
        jnp.array([True, True, True, False]), mask, num_groups=4)
    tok = np.array([0.5, -0.5, -0.5, 5.0])
    w = (tok - tok.mean()) / np.sqrt(tok.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(adv, [[w[0], 0], [w[1], w[2]], [w[3], 0], [0, 0]], rtol=1e-5)


def gae_reference(r, v, m, gamma, lam):
    """verl's loop: masked tokens carry the next value and the running advantage."""
    B, T = r.shape
    adv = np.zeros((B, T))
    for i in range(B):
        next_v = last = 0.0
        for t in reversed(range(T)):
            a = r[i, t] + gamma * next_v - v[i, t] + gamma * lam * last
            if m[i, t]:
                next_v, last = v[i, t], a
                adv[i, t] = a
    return adv, np.where(m, adv + v, 0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_python_loop(seed):
    rng = np.random.default_rng(seed)
    r, v = rng.normal(size=(2, 5, 9))
    m = rng.random((5, 9)) < 0.7
    m[3] = False  # an all-masked row
    (adv, ret), _ = A.gae_advantages(r, v, m, gamma=0.9, lam=0.8, whiten=False)
    want_adv, want_ret = gae_reference(r, v, m, 0.9, 0.8)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-4, atol=1e-5)
    (wadv, _), _ = A.gae_advantages(r, v, m, gamma=0.9, lam=0.8)
    x = want_adv[m]
    np.testing.assert_allclose(wadv[m], (x - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8),
                               rtol=1e-4, atol=1e-5)


def test_gae_closed_forms():
    # delta_1 = 1 - 0.2 = 0.8; delta_0 = 0.9 * 0.2 - 0.5 = -0.32; A_0 = -0.32 + 0.72 * 0.8.
    (adv, ret), _ = A.gae_advantages(jnp.array([[0.0, 1.0]]), jnp.array([[0.5, 0.2]]),
                                     jnp.ones((1, 2), bool), gamma=0.9, lam=0.8, whiten=False)
    np.testing.assert_allclose(adv, [[0.256, 0.8]], rtol=1e-5)
    np.testing.assert_allclose(ret, [[0.756, 1.0]], rtol=1e-5)
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t.
    r = jnp.array([[0.5, 0.0, 2.0]])
    v = jnp.array([[1.0, 3.0, -1.0]])
    (adv, _), _ = A.gae_advantages(r, v, jnp.ones((1, 3), bool), whiten=False)
    np.testing.assert_allclose(adv, [[1.5, -1.0, 3.0]], rtol=1e-6)


# ----- advantages_from_spec --------------------------------------------------------------------

def random_batch(seed, B=12, T=6, ng=5):
    rng = np.random.default_rng(seed)
    rewards = np.where(rng.random(B) < 0.5, rng.integers(0, 2, B), rng.normal(size=B))
    rewards = rewards.astype(np.float32)
    gids = rng.integers(0, ng, B).astype(np.int32)
    gids[:3] = 0  # one constant group, so the dynamic filter has work
    rewards[:3] = 1.0
    valid = rng.random(B) < 0.85
    valid[:3] = True
    lengths = rng.integers(1, T + 1, B)
    mask = (np.arange(T)[None] < lengths[:, None]) & (rng.random((B, T)) < 0.85)
    mask[np.arange(B), 0] = True
    return dict(rewards=rewards, group_ids=gids, valid=valid, response_mask=mask, num_groups=ng)


SPECS = [AdvantageSpec(estimator=e, gamma=g, dynamic_sampling=d, overlong_max_len=ml,
                       overlong_buffer=2)
         for e in A.ESTIMATORS for g, d, ml in [(1.0, False, 0), (0.9, True, 5)]]


def spec_id(s):
    return f"{s.estimator}-ds{int(s.dynamic_sampling)}-ol{s.overlong_max_len}"


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_from_spec_permutation_padding_and_jit(spec):
    b = random_batch(7)
    adv, met = A.advantages_from_spec(spec, **b)
    assert set(met) == METRIC_KEYS
    assert np.all(np.isfinite(adv))
    np.testing.assert_array_equal(np.asarray(adv)[~(b["response_mask"] & b["valid"][:, None])], 0)

    perm = np.random.default_rng(3).permutation(len(b["rewards"]))
    pb = {k: (v[perm] if isinstance(v, np.ndarray) else v) for k, v in b.items()}
    padv, pmet = A.advantages_from_spec(spec, **pb)
    np.testing.assert_allclose(padv, np.asarray(adv)[perm], rtol=1e-5, atol=1e-6)
    for k in met:
        np.testing.assert_allclose(pmet[k], met[k], rtol=1e-5, atol=1e-6, err_msg=k)

    # Padding rows with NaN rewards, bogus ids and full masks change nothing for the others.
    n_pad = 3
    xb = dict(b)
    xb["rewards"] = np.concatenate([b["rewards"], [np.nan, 5.0, -7.0]]).astype(np.float32)
    xb["group_ids"] = np.concatenate([b["group_ids"], [-1, 0, 99]]).astype(np.int32)
    xb["valid"] = np.concatenate([b["valid"], [False] * n_pad])
    xb["response_mask"] = np.concatenate([b["response_mask"], np.ones((n_pad, 6), bool)])
    xadv, xmet = A.advantages_from_spec(spec, **xb)
    np.testing.assert_allclose(xadv[:-n_pad], adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(xadv[-n_pad:], 0.0)
    for k in met:
        np.testing.assert_allclose(xmet[k], met[k], rtol=1e-5, atol=1e-6, err_msg=k)

    ng = b.pop("num_groups")
    jitted = jax.jit(lambda **kw: A.advantages_from_spec(spec, num_groups=ng, **kw))
    jadv, jmet = jitted(**b)
    np.testing.assert_allclose(jadv, adv, rtol=1e-5, atol=1e-6)
    for k in met:
        np.testing.assert_allclose(jmet[k], met[k], rtol=1e-5, atol=1e-6, err_msg=k)


METRIC_KEYS = {"adv_mean", "adv_std", "adv_min", "adv_max", "reward_mean", "reward_std",
               "zero_std_group_frac", "kept_seq_frac", "kept_group_frac", "overlong_frac",
               "overlong_penalty_mean", "num_seqs", "num_tokens"}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_grpo_sums_to_zero_and_rloo_is_leave_one_out(seed):
    b = random_batch(seed, B=16)
    r, g, v = b["rewards"], b["group_ids"], b["valid"]
    adv, _ = A.grpo_advantages(r, g, v, num_groups=5)
    rloo, _ = A.rloo_advantages(r, g, v, num_groups=5)
    adv, rloo = np.asarray(adv), np.asarray(rloo)
    for gid in range(5):
        idx = np.flatnonzero(v & (g == gid))
        if len(idx) < 2:
            continue
        n, mean = len(idx), r[idx].mean()
        # float32 rounding of R - mean is ~eps * |R|, then amplified by 1 / std.
        std = r[idx].std(ddof=1)
        tol = 4 * np.finfo(np.float32).eps * n * np.abs(r[idx]).max() / std if std > 0 else 0.0
        np.testing.assert_allclose(adv[idx].sum(), 0.0, atol=max(tol, 1e-6))
        np.testing.assert_allclose(rloo[idx], n / (n - 1) * (r[idx] - mean), rtol=1e-5, atol=1e-6)
        for i in idx:
            others = [r[j] for j in idx if j != i]
            np.testing.assert_allclose(rloo[i], r[i] - np.mean(others), rtol=1e-5, atol=1e-6)


def test_from_spec_grpo_broadcast_and_overlong_shaping():
    # max_len 4, buffer 2: lengths 1, 3, 4, 2 -> penalties 0, -0.5, -1, 0 (factor 1).
    mask = jnp.array([[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], bool)
    spec = AdvantageSpec(estimator="dr_grpo", overlong_max_len=4, overlong_buffer=2)
    adv, met = A.advantages_from_spec(spec, rewards=jnp.array([1.0, 1.0, 0.0, 0.0]),
                                      group_ids=jnp.array([0, 0, 1, 1]), valid=jnp.ones(4, bool),
                                      response_mask=mask, num_groups=2)
    # Shaped: [1, 0.5 | -1, 0] -> Dr.GRPO [0.25, -0.25 | -0.5, 0.5], broadcast over the mask.
    np.testing.assert_allclose(adv, np.where(mask, np.array([0.25, -0.25, -0.5, 0.5])[:, None], 0),
                               rtol=1e-6)
    np.testing.assert_allclose(met["overlong_frac"], 0.5)
    np.testing.assert_allclose(met["overlong_penalty_mean"], -0.375)
    np.testing.assert_allclose(met["reward_mean"], 0.125)
    # Explicit lengths override the mask count (tool-token holes).
    adv2, met2 = A.advantages_from_spec(spec, rewards=jnp.array([1.0, 1.0, 0.0, 0.0]),
                                        group_ids=jnp.array([0, 0, 1, 1]),
                                        valid=jnp.ones(4, bool), response_mask=mask,
                                        num_groups=2, response_lengths=jnp.array([1, 1, 1, 1]))
    np.testing.assert_allclose(met2["overlong_frac"], 0.0)
    np.testing.assert_array_equal(adv2, 0.0)


def test_from_spec_dynamic_sampling_filters_on_raw_rewards():
    # Group 0: all correct but of different lengths (shaped rewards differ): dropped, because
    # the filter looks at the raw rewards. Group 1: mixed, kept. Group 2: singleton, dropped.
    rewards = jnp.array([1.0, 1.0, 1.0, 0.0, 0.0])
    gids = jnp.array([0, 0, 1, 1, 2])
    mask = jnp.array([[1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], bool)
    base = dict(rewards=rewards, group_ids=gids, valid=jnp.ones(5, bool), response_mask=mask,
                num_groups=3)
    spec = AdvantageSpec(estimator="reinforce_pp_baseline", dynamic_sampling=True,
                         overlong_max_len=3, overlong_buffer=2)
    adv, met = A.advantages_from_spec(spec, **base)
    np.testing.assert_array_equal(np.asarray(adv)[[0, 1, 4]], 0.0)
    # Kept: group 1 shaped [1, 0 - 0.5] -> [0.75, -0.75] on tokens (1 + 2), whitened alone.
    tok = np.array([0.75, -0.75, -0.75])
    w = (tok - tok.mean()) / np.sqrt(tok.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(adv[2], [w[0], 0, 0], rtol=1e-5)
    np.testing.assert_allclose(adv[3], [w[1], w[2], 0], rtol=1e-5)
    np.testing.assert_allclose(met["kept_seq_frac"], 2 / 5)
    np.testing.assert_allclose(met["kept_group_frac"], 1 / 3)
    np.testing.assert_allclose(met["num_tokens"], 3)
    # Shaped group 0 rewards differ, so only the singleton has zero spread before filtering.
    np.testing.assert_allclose(met["zero_std_group_frac"], 1 / 3)
    # filter_values overrides the metric the filter tests: now group 0 differs and is kept.
    adv, met = A.advantages_from_spec(spec, filter_values=jnp.array([1.0, 0.0, 1.0, 0.0, 0.0]),
                                      **base)
    np.testing.assert_allclose(met["kept_seq_frac"], 4 / 5)
    assert np.all(np.asarray(adv[0:2, 0]) != 0.0)


def test_from_spec_errors_name_the_field():
    base = dict(rewards=R, group_ids=G, valid=V, response_mask=jnp.ones((7, 2), bool),
                num_groups=NG)
    bad_spec = types.SimpleNamespace(**dataclasses.asdict(AdvantageSpec()))
    bad_spec.estimator = "ppo"
    with pytest.raises(ValueError, match="AdvantageSpec.estimator.*'ppo'"):
        A.advantages_from_spec(bad_spec, **base)
    with pytest.raises(ValueError, match=r"group_ids\[1\] = 8 is outside"):
        A.advantages_from_spec(AdvantageSpec(), **{**base, "group_ids": G.at[1].set(8)})
    with pytest.raises(ValueError, match="response_mask must be"):
        A.advantages_from_spec(AdvantageSpec(), **{**base, "response_mask": jnp.ones(7, bool)})
    with pytest.raises(ValueError, match="rewards, group_ids, valid"):
        A.grpo_advantages(R[:3], G, V, num_groups=NG)
    with pytest.raises(ValueError, match="num_groups"):
        A.grpo_advantages(R, G, V, num_groups=0)
