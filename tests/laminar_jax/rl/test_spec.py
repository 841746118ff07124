"""Spec dataclasses: defaults (the paper's objective), range checks, needed recomputes."""
import subprocess
import sys

import pytest

from laminar_jax.rl.spec import (AdvantageSpec, AggregationSpec, CorrectionSpec, KLSpec, LossSpec,
                                 SurrogateSpec)


def test_defaults_are_the_papers_objective():
    s = LossSpec()
    assert (s.surrogate.kind, s.surrogate.eps_low, s.surrogate.eps_high) == ("ppo", 0.2, 0.28)
    assert s.surrogate.dual_clip_c is None
    assert s.aggregation.mode == "token-mean"
    assert AdvantageSpec().estimator == "grpo"
    c = s.correction
    assert c.old == "prox" and not c.has_behaviour_weight and c.reject_level == "none"
    # the entropy metric is measured by default (log_entropy), no entropy term in the loss
    assert s.needs_prox and not s.needs_ref and s.needs_entropy and s.log_entropy
    assert not LossSpec(log_entropy=False).needs_entropy
    assert s.kl.coef == 0.0 and s.entropy_coef == 0.0


def test_needs_flags():
    s = LossSpec(correction=CorrectionSpec(old="behaviour"), kl=KLSpec(coef=0.001),
                 entropy_coef=0.01)
    assert not s.needs_prox and s.needs_ref and s.needs_entropy


@pytest.mark.parametrize("make,pattern", [
    (lambda: AdvantageSpec(estimator="ppo"), r"AdvantageSpec\.estimator='ppo'"),
    (lambda: AdvantageSpec(eps=0.0), r"AdvantageSpec\.eps=0\.0: expected"),
    (lambda: AdvantageSpec(gamma=1.5), r"AdvantageSpec\.gamma=1\.5"),
    (lambda: AdvantageSpec(overlong_max_len=10, overlong_buffer=20), "overlong_buffer=20"),
    (lambda: SurrogateSpec(kind="trpo"), r"SurrogateSpec\.kind='trpo'"),
    (lambda: SurrogateSpec(eps_high=-0.1), "eps_high=-0.1"),
    (lambda: SurrogateSpec(dual_clip_c=1.0), "dual_clip_c=1.0: expected None"),
    (lambda: SurrogateSpec(kind="cispo", dual_clip_c=3.0), "unless kind is 'ppo' or 'dppo'"),
        (lambda: SurrogateSpec(kind="sapo", sapo_tau_neg=0.0), "sapo_tau_neg=0.0"),
        (lambda: CorrectionSpec(old="ewma", ewma_decay=1.0), "ewma_decay=1.0"),
        (lambda: CorrectionSpec(old="exact"), "old='exact'"),
        (lambda: LossSpec(log_entropy=1), "log_entropy=1"),
    (lambda: CorrectionSpec(old="ref"), r"CorrectionSpec\.old='ref'"),
    (lambda: CorrectionSpec(is_level="tokens"), "is_level='tokens'"),
    (lambda: CorrectionSpec(is_min=2.0, is_max=1.0), "is_max=1.0"),
    (lambda: CorrectionSpec(reject_low=2.0, reject_high=1.0), "reject_high=1.0"),
    (lambda: CorrectionSpec(vtrace_rho_bar=0.0), "vtrace_rho_bar=0.0"),
    (lambda: CorrectionSpec(m2po_tau=-1.0), "m2po_tau=-1.0"),
    (lambda: CorrectionSpec(max_staleness=-1), "max_staleness=-1"),
    (lambda: CorrectionSpec(staleness_decay=1.5), "staleness_decay=1.5"),
    (lambda: AggregationSpec(mode="token-average"), "mode='token-average'"),
    (lambda: AggregationSpec(mode="seq-mean-token-sum-norm"), "norm_constant=0.0"),
    (lambda: KLSpec(estimator="k4"), "estimator='k4'"),
    (lambda: KLSpec(coef=-1.0), r"KLSpec\.coef=-1\.0"),
    (lambda: LossSpec(staleness_bins=0), "staleness_bins=0"),
    (lambda: LossSpec(entropy_coef=float("nan")), "entropy_coef=nan"),
    (lambda: LossSpec(correction=CorrectionSpec(old="behaviour", is_level="token")),
     "count twice"),
    (lambda: LossSpec(surrogate=SurrogateSpec(kind="gspo"),
                      correction=CorrectionSpec(old="behaviour", topr=True)), "count twice"),
])
def test_bad_values_name_field_value_and_expectation(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_bypass_weights_are_allowed_with_reinforce():
    s = LossSpec(surrogate=SurrogateSpec(kind="reinforce"),
                 correction=CorrectionSpec(old="behaviour", is_level="sequence", topr=True))
    assert not s.needs_prox


def test_spec_module_does_not_import_jax():
    code = "import sys, laminar_jax.rl.spec; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
