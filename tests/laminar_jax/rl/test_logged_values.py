"""Logged values match their formulas (issue 17): each case is a closed form that the former
code got wrong (approx_kl, IcePop masked_frac, entropy 0.0), plus the SAPO / DPPO surrogates,
the mismatch metrics and the ratio guard (stale behaviour log-prob -90 vs learner 0)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.rl import losses
from laminar_jax.rl.compose import make_loss
from laminar_jax.rl.metrics import METRIC_KEYS
from laminar_jax.rl.spec import AggregationSpec, CorrectionSpec, LossSpec, SurrogateSpec


def _row(values):
    return jnp.asarray([values], jnp.float32)


def _loss(spec, learner, **kw):
    fn = make_loss(spec)
    (value, metrics), grad = jax.value_and_grad(lambda x: fn(x, **kw), has_aux=True)(learner)
    return float(value), {k: np.asarray(v) for k, v in metrics.items()}, np.asarray(grad)


def test_approx_kl_is_k3_of_the_ratio_to_old():
    # one token with r = pi / pi_old = 2: k3 = r - 1 - log r = 1 - log 2 = 0.3069
    # (the former 1/r - 1 + log r gave 0.1931)
    old = _row([-1.0])
    spec = LossSpec(correction=CorrectionSpec(old="prox"))
    _, m, _ = _loss(spec, old + math.log(2.0), behaviour_logp=old, prox_logp=old,
                    advantages=_row([1.0]), mask=_row([1.0]))
    np.testing.assert_allclose(m["approx_kl"], 1.0 - math.log(2.0), rtol=1e-6)


def test_icepop_masked_tokens_are_counted():
    # IcePop zeroes the weight of tokens whose pi_old / mu is outside [0.5, 5]: rho = 10 and 0.25
    lp = _row([-1.0, -1.0, -1.0, -1.0])
    mu = lp - jnp.log(_row([10.0, 0.25, 1.0, 2.0]))
    spec = LossSpec(correction=CorrectionSpec(is_level="token", is_mode="mask", is_min=0.5,
                                              is_max=5.0))
    value, m, grad = _loss(spec, lp, behaviour_logp=mu, prox_logp=lp,
                           advantages=_row([1.0] * 4), mask=_row([1.0] * 4))
    assert float(m["masked_frac"]) == 0.5  # the former code reported 0
    assert float(m["masked_seq_frac"]) == 1.0 and float(m["num_kept_tokens"]) == 2.0
    assert float(m["tis_clip_frac"]) == 0.5
    # weights 1 and 2 on the kept tokens, denominator 4 (rejected stay in it by default)
    np.testing.assert_allclose(value, -(1.0 + 2.0) / 4, rtol=1e-6)
    np.testing.assert_allclose(grad, [[0.0, 0.0, -0.25, -0.5]], rtol=1e-6)


def test_tis_clip_fraction_counts_truncated_weights():
    lp = _row([-1.0, -1.0, -1.0])
    mu = lp - jnp.log(_row([3.0, 1.5, 0.5]))
    spec = LossSpec(correction=CorrectionSpec(is_level="token", is_min=0.6, is_max=2.0))
    _, m, _ = _loss(spec, lp, behaviour_logp=mu, prox_logp=lp, advantages=_row([1.0] * 3),
                    mask=_row([1.0] * 3))
    np.testing.assert_allclose(m["tis_clip_frac"], 2 / 3, rtol=1e-6)
    assert float(m["masked_frac"]) == 0.0  # truncation keeps every token
    np.testing.assert_allclose(m["is_weight_max"], 2.0, rtol=1e-6)
    np.testing.assert_allclose(m["is_weight_min"], 0.6, rtol=1e-6)


def test_mismatch_metrics_closed_form_and_fixed_keys():
    # delta = l - l_mu = [log 2, -log 2]: k1 = mean(-delta) = 0, k3 = mean(r - 1 - delta) =
    # (1 - log 2 + (-0.5 + log 2)) / 2 = 0.25, chi2 = mean((r - 1)^2) = (1 + 0.25) / 2
    lp = _row([-1.0, -1.0, 5.0])
    mu = lp - _row([math.log(2.0), -math.log(2.0), 0.0])
    mask = _row([1.0, 1.0, 0.0])
    keys = None
    for spec in (LossSpec(), LossSpec(correction=CorrectionSpec(is_level="token")),
                 LossSpec(surrogate=SurrogateSpec(kind="sapo")),
                 LossSpec(correction=CorrectionSpec(old="behaviour", reject_level="token"))):
        _, m, _ = _loss(spec, lp, behaviour_logp=mu, prox_logp=lp, advantages=_row([1.0] * 3),
                        mask=mask)
        np.testing.assert_allclose(m["mismatch_k1"], 0.0, atol=1e-7)
        np.testing.assert_allclose(m["mismatch_k3"], 0.25, rtol=1e-5)
        np.testing.assert_allclose(m["mismatch_chi2"], 0.625, rtol=1e-5)
        np.testing.assert_allclose(m["mismatch_abs_max"], math.log(2.0), rtol=1e-6)
        assert set(m) == set(METRIC_KEYS)
        keys = keys or set(m)
        assert set(m) == keys


def test_entropy_is_measured_or_nan_never_a_fake_zero():
    lp, mask = _row([-1.0, -2.0]), _row([1.0, 1.0])
    kw = dict(behaviour_logp=lp, prox_logp=lp, advantages=_row([1.0, 1.0]), mask=mask)
    _, m, _ = _loss(LossSpec(), lp, entropy=_row([0.5, 1.5]), **kw)
    np.testing.assert_allclose(m["entropy"], 1.0, rtol=1e-6)
    _, m, _ = _loss(LossSpec(), lp, **kw)
    assert np.isnan(m["entropy"])
    with pytest.raises(ValueError, match="entropy"):
        _loss(LossSpec(entropy_coef=0.1), lp, **kw)


def test_sapo_soft_gate_closed_form():
    # f(r) = (4 / tau) sigmoid(tau (r - 1)); tau = 1 for A > 0, 1.05 for A < 0
    ratio, adv = [1.0, 2.0, 0.5], [1.0, 1.0, -2.0]
    old = _row([-1.0] * 3)
    learner = old + jnp.log(_row(ratio))
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731

    def total(x):
        tok, aux = losses.sapo(x, old, _row(adv), _row([1.0] * 3), tau_pos=1.0, tau_neg=1.05)
        return jnp.sum(tok), tok

    (_, tok), g = jax.value_and_grad(total, has_aux=True)(learner)
    want, want_g = [], []
    for r, a in zip(ratio, adv):
        tau = 1.0 if a > 0 else 1.05
        s = sig(tau * (r - 1.0))
        want.append(-a * 4.0 / tau * s)
        want_g.append(-a * r * 4.0 * s * (1.0 - s))
    np.testing.assert_allclose(tok[0], want, rtol=1e-6)
    np.testing.assert_allclose(g[0], want_g, rtol=1e-5)
    assert want_g[0] == -1.0  # PPO's gradient -A r at r = 1


def test_dppo_probability_difference_mask_closed_form():
    # p_old = 0.5 everywhere; delta = 0.2
    # t0: A>0, p 0.8 (dp +0.3 > 0.2) -> masked;  t1: A>0, p 0.6 (dp +0.1) -> -A r
    # t2: A<0, p 0.2 (dp -0.3 < -0.2) -> masked; t3: A<0, p 0.9 (dp +0.4, prob went up) -> kept
    p = np.array([0.8, 0.6, 0.2, 0.9])
    adv = _row([1.0, 1.0, -1.0, -1.0])
    old = _row([math.log(0.5)] * 4)
    learner = jnp.log(jnp.asarray([p], jnp.float32))

    def run(**kw):
        def total(x):
            tok, aux = losses.dppo(x, old, adv, _row([1.0] * 4), eps_low=0.2, eps_high=0.2, **kw)
            return jnp.sum(tok), (tok, aux)
        (_, (tok, aux)), g = jax.value_and_grad(total, has_aux=True)(learner)
        return np.asarray(tok[0]), aux, np.asarray(g[0])

    r = p / 0.5
    tok, aux, g = run()
    np.testing.assert_allclose(tok, [0.0, -r[1], 0.0, r[3]], rtol=1e-5)
    np.testing.assert_allclose(g, [0.0, -r[1], 0.0, r[3]], rtol=1e-5)
    np.testing.assert_array_equal(aux["clipped_high"][0], [1, 0, 0, 0])
    np.testing.assert_array_equal(aux["clipped_low"][0], [0, 0, 1, 0])
    # dual_clip_c caps the A < 0 token whose ratio grew: min(1.8, 1.5 * 1) = 1.5, no gradient
    tok, aux, g = run(dual_clip_c=1.5)
    np.testing.assert_allclose(tok[3], 1.5, rtol=1e-6)
    assert g[3] == 0.0 and aux["clipped_dual"][0, 3] == 1


@pytest.mark.parametrize("kind", ["sapo", "dppo"])
def test_new_surrogates_reach_the_loss_from_the_spec(kind):
    # the config name changes the loss: same batch, different value than PPO
    old = _row([-1.0, -1.0])
    learner = old + jnp.log(_row([1.6, 0.9]))
    kw = dict(behaviour_logp=old, prox_logp=old, advantages=_row([1.0, -1.0]),
              mask=_row([1.0, 1.0]))
    ppo, _, _ = _loss(LossSpec(), learner, **kw)
    new, _, _ = _loss(LossSpec(surrogate=SurrogateSpec(kind=kind, eps_low=0.05, eps_high=0.05)),
                      learner, **kw)
    assert abs(new - ppo) > 1e-3


SURROGATE_KINDS = ["ppo", "gspo", "gspo_token", "cispo", "gmpo", "sapo", "dppo", "reinforce"]


@pytest.mark.parametrize("correction", [
    CorrectionSpec(old="behaviour"),
    CorrectionSpec(old="prox", is_level="token", is_max=None),
    CorrectionSpec(old="prox", is_level="sequence", is_mode="mask", is_min=0.5, is_max=5.0),
    CorrectionSpec(old="prox", vtrace=True, topr=True, reject_level="geometric"),
], ids=["bypass", "decoupled_is_unbounded", "seq_mask", "vtrace_topr_geo"])
@pytest.mark.parametrize("kind", SURROGATE_KINDS)
def test_ratio_guard_stale_behaviour_minus_90(kind, correction):
    """Behaviour log-prob -90 against learner 0: exp(90) overflows fp32, so an unguarded ratio
    would give inf and 0 * inf = NaN. Every log-ratio is clamped to 20 before exp: the loss and
    its gradient are finite and equal the closed form of the clamped expression."""
    if correction.old == "behaviour" and correction.has_behaviour_weight and kind != "reinforce":
        pytest.skip("rejected by LossSpec")
    lp = _row([0.0, -0.5])          # learner; token 1 is fresh
    mu = _row([-90.0, -0.5])         # token 0 sampled by a very stale policy
    adv = _row([1.0, -1.0])
    spec = LossSpec(surrogate=SurrogateSpec(kind=kind, eps_low=0.2, eps_high=0.28),
                    correction=correction, aggregation=AggregationSpec(mode="token-mean"))
    value, m, grad = _loss(spec, lp, behaviour_logp=mu, prox_logp=lp, advantages=adv,
                           mask=_row([1.0, 1.0]))
    assert math.isfinite(value) and np.all(np.isfinite(grad))
    assert all(np.all(np.isfinite(v)) for k, v in m.items() if k != "entropy")
    if correction.old == "behaviour":
        # r = exp(min(0 + 90, 20)) on token 0; token 1 has r = 1
        big = math.exp(20.0)
        tok0 = {"ppo": -1.28, "gspo": None, "gspo_token": None, "cispo": -1.28 * 0.0,
                "gmpo": None, "sapo": -4.0 * (1 / (1 + math.exp(-(big - 1)))),
                "dppo": 0.0, "reinforce": 0.0}[kind]
        tok1 = {"ppo": 1.0, "cispo": -0.5, "sapo": 2.0 / 1.05, "dppo": 1.0,
                "reinforce": -0.5}.get(kind)
        if tok0 is not None:
            np.testing.assert_allclose(value, (tok0 + tok1) / 2, rtol=1e-5)
        # the clamped token's gradient: clipped (PPO), gate saturated (SAPO), masked (DPPO:
        # p - p_old = 1 > 0.28) -> 0; CISPO keeps -r_hat A = -1.28 / 2, REINFORCE -A / 2
        g0 = {"ppo": 0.0, "sapo": 0.0, "dppo": 0.0, "cispo": -1.28 / 2, "reinforce": -0.5}.get(kind)
        if g0 is not None:
            np.testing.assert_allclose(grad[0, 0], g0, atol=1e-6)
    else:
        # decoupled: the ratio to prox is 1; the weight exp(min(90, 20)) is finite
        assert np.all(np.abs(grad) < 1e12)
