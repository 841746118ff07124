"""Frozen specs of the loss composition (no JAX import: the CLI and config loader read these).

A `LossSpec` is a surrogate, an off-policy correction, an aggregation, a KL penalty and an entropy
bonus; `laminar_jax.rl.compose.make_loss(spec)` turns it into a loss function, so an ablation is a
YAML change. Defaults give the Laminar paper's objective (arXiv 2510.12633 section 8): GRPO
advantages, DAPO clip-higher (eps_low 0.2, eps_high 0.28), token-mean aggregation, the PPO anchor
recomputed by the trainer (verl's GRPO) and no behaviour correction.

Every formula and config name is listed in docs/corrections.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
SURROGATES = ("ppo", "gspo", "gspo_token", "cispo", "gmpo", "sapo", "dppo", "reinforce")
# Surrogates whose value contains the ratio learner / old: an extra pi/mu weight in bypass mode
# would count the behaviour correction twice (verl applies no IS weight in bypass + ppo_clip).
RATIO_SURROGATES = ("ppo", "gspo", "gspo_token", "cispo", "gmpo", "sapo", "dppo")
# Ways to get the PPO anchor (CorrectionSpec.old).
OLD_POLICIES = ("behaviour", "prox", "ewma")
AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _fail(spec: str, name: str, value, expected: str):
    raise ValueError(f"{spec}.{name}={value!r}: expected {expected}")


def _check(cond: bool, spec: str, name: str, value, expected: str):
    if not cond:
        _fail(spec, name, value, expected)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class AdvantageSpec:
    """Advantage estimator (computed by `laminar_jax.rl.advantages`)."""

    estimator: str = "grpo"
    eps: float = 1e-6
    gamma: float = 1.0
    dynamic_sampling: bool = False
    overlong_max_len: int = 0  # 0 = overlong shaping off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self):
        s = "AdvantageSpec"
        _check(self.estimator in ADVANTAGE_ESTIMATORS, s, "estimator", self.estimator,
               f"one of {ADVANTAGE_ESTIMATORS}")
        _check(_finite(self.eps) and self.eps > 0, s, "eps", self.eps, "a finite float > 0")
        _check(_finite(self.gamma) and 0 < self.gamma <= 1, s, "gamma", self.gamma,
               "0 < gamma <= 1")
        _check(isinstance(self.overlong_max_len, int) and self.overlong_max_len >= 0, s,
               "overlong_max_len", self.overlong_max_len, "an int >= 0 (0 = off)")
        _check(isinstance(self.overlong_buffer, int) and self.overlong_buffer >= 0, s,
               "overlong_buffer", self.overlong_buffer, "an int >= 0")
        if self.overlong_max_len > 0:
            _check(self.overlong_buffer <= self.overlong_max_len, s, "overlong_buffer",
                   self.overlong_buffer, f"<= overlong_max_len ({self.overlong_max_len})")
        _check(_finite(self.overlong_penalty) and self.overlong_penalty >= 0, s,
               "overlong_penalty", self.overlong_penalty, "a finite float >= 0")


@dataclass(frozen=True)
class SurrogateSpec:
    """Per-token policy surrogate.

    kind: "ppo" (clip / clip-higher, plus dual-clip when dual_clip_c is set), "gspo" (sequence
    ratio), "gspo_token", "cispo", "gmpo" (eps are log-ratio bounds there), "sapo" (soft gate,
    eps unused), "dppo" (eps are probability-difference bounds, dual_clip_c caps A < 0),
    "reinforce".
    eps_low / eps_high: clip range [1 - eps_low, 1 + eps_high] of the ratio (GMPO: [-eps_low,
    eps_high] of the log-ratio; DPPO: bounds on p - p_old). CISPO with eps_low >= 1 has no lower
    bound, and TRL's absolute cap `min(r, C)` is eps_low >= 1, eps_high = C - 1.
    sapo_tau_pos / sapo_tau_neg: SAPO's gate temperatures for A > 0 / A <= 0 (arXiv 2511.20347).
    """

    kind: Literal["ppo", "gspo", "gspo_token", "cispo", "gmpo", "sapo", "dppo",
                  "reinforce"] = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip_c: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05

    def __post_init__(self):
        s = "SurrogateSpec"
        _check(self.kind in SURROGATES, s, "kind", self.kind, f"one of {SURROGATES}")
        _check(_finite(self.eps_low) and self.eps_low >= 0, s, "eps_low", self.eps_low,
               "a finite float >= 0")
        _check(_finite(self.eps_high) and self.eps_high >= 0, s, "eps_high", self.eps_high,
               "a finite float >= 0")
        if self.dual_clip_c is not None:
            _check(_finite(self.dual_clip_c) and self.dual_clip_c > 1, s, "dual_clip_c",
                   self.dual_clip_c, "None (off) or a finite float > 1 (dual-clip PPO)")
            _check(self.kind in ("ppo", "dppo"), s, "dual_clip_c", self.dual_clip_c,
                   f"None unless kind is 'ppo' or 'dppo' (kind is {self.kind!r})")
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            _check(_finite(getattr(self, name)) and getattr(self, name) > 0, s, name,
                   getattr(self, name), "a finite float > 0")


@dataclass(frozen=True)
class CorrectionSpec:
    """Off-policy and staleness corrections; each option multiplies a detached weight or a mask.

    old: the PPO anchor. "behaviour" = bypass (engine log-probs, no recompute); "prox" = the
    trainer's recompute at consumption time (decoupled PPO when a behaviour weight is added);
    "ewma" = the recompute with an EWMA of the learner's weights, theta_ewma <- ewma_decay *
    theta_ewma + (1 - ewma_decay) * theta after every optimizer update (PPO-EWMA, Hilton et al.
    arXiv 2110.00641; the proximal policy of arXiv 2605.12070). ewma_decay: that beta.
    The behaviour log-ratio lambda = log(old / mu) ("prox") or log(sg(learner) / mu) ("behaviour").
    is_level: importance weight from lambda: "token" exp(lambda_t), "sequence" exp(sum lambda),
    "geometric" exp(mean lambda). is_mode: "truncate" clip(w, is_min, is_max) (TIS) or "mask"
    w * 1[is_min <= w <= is_max] (IcePop / masked IS). is_max None = no upper bound.
    reject_level: rejection (mask) on the same statistic with bounds [reject_low, reject_high].
    opsm_delta: drop sequences with A < 0 and mean(mu - sg(learner)) > delta (DeepSeek-V3.2).
    vtrace: V-trace weights with rho_bar / c_bar (IMPALA), terminal-reward form.
    m2po_tau: second-moment mask threshold (M2PO). topr: TOPR sequence weights for A < 0.
    max_staleness: mask tokens staler than this. staleness_decay: weight lambda ** staleness
    (a new ablation, no published source).
    """

    old: Literal["behaviour", "prox", "ewma"] = "prox"
    ewma_decay: float = 0.9
    is_level: Literal["none", "token", "sequence", "geometric"] = "none"
    is_mode: Literal["truncate", "mask"] = "truncate"
    is_min: float = 0.0
    is_max: float | None = 2.0
    reject_level: Literal["none", "token", "sequence", "geometric"] = "none"
    reject_low: float = 0.5
    reject_high: float | None = 2.0
    opsm_delta: float | None = None
    vtrace: bool = False
    vtrace_rho_bar: float = 1.0
    vtrace_c_bar: float = 1.0
    m2po_tau: float | None = None
    topr: bool = False
    max_staleness: int | None = None
    staleness_decay: float | None = None

    def __post_init__(self):
        s = "CorrectionSpec"
        levels = ("none", "token", "sequence", "geometric")
        _check(self.old in OLD_POLICIES, s, "old", self.old, f"one of {OLD_POLICIES}")
        _check(_finite(self.ewma_decay) and 0 <= self.ewma_decay < 1, s, "ewma_decay",
               self.ewma_decay, "a float in [0, 1) (0 = the current weights, as 'prox')")
        _check(self.is_level in levels, s, "is_level", self.is_level, f"one of {levels}")
        _check(self.is_mode in ("truncate", "mask"), s, "is_mode", self.is_mode,
               "'truncate' or 'mask'")
        _check(_finite(self.is_min) and self.is_min >= 0, s, "is_min", self.is_min,
               "a finite float >= 0")
        if self.is_max is not None:
            _check(_finite(self.is_max) and self.is_max > self.is_min, s, "is_max", self.is_max,
                   f"None or a finite float > is_min ({self.is_min})")
        _check(self.reject_level in levels, s, "reject_level", self.reject_level,
               f"one of {levels}")
        _check(_finite(self.reject_low) and self.reject_low >= 0, s, "reject_low",
               self.reject_low, "a finite float >= 0")
        if self.reject_high is not None:
            _check(_finite(self.reject_high) and self.reject_high > self.reject_low, s,
                   "reject_high", self.reject_high,
                   f"None or a finite float > reject_low ({self.reject_low})")
        if self.opsm_delta is not None:
            _check(_finite(self.opsm_delta) and self.opsm_delta >= 0, s, "opsm_delta",
                   self.opsm_delta, "None (off) or a finite float >= 0")
        _check(_finite(self.vtrace_rho_bar) and self.vtrace_rho_bar > 0, s, "vtrace_rho_bar",
               self.vtrace_rho_bar, "a finite float > 0")
        _check(_finite(self.vtrace_c_bar) and self.vtrace_c_bar > 0, s, "vtrace_c_bar",
               self.vtrace_c_bar, "a finite float > 0")
        if self.m2po_tau is not None:
            _check(_finite(self.m2po_tau) and self.m2po_tau > 0, s, "m2po_tau", self.m2po_tau,
                   "None (off) or a finite float > 0")
        if self.max_staleness is not None:
            _check(isinstance(self.max_staleness, int) and not isinstance(self.max_staleness, bool)
                   and self.max_staleness >= 0, s, "max_staleness", self.max_staleness,
                   "None (off) or an int >= 0")
        if self.staleness_decay is not None:
            _check(_finite(self.staleness_decay) and 0 < self.staleness_decay <= 1, s,
                   "staleness_decay", self.staleness_decay, "None (off) or 0 < decay <= 1")

    @property
    def has_behaviour_weight(self) -> bool:
        """True when some option multiplies the loss by a function of pi / mu."""
        return self.is_level != "none" or self.vtrace or self.topr


@dataclass(frozen=True)
class AggregationSpec:
    """How per-token losses become a scalar (verl's `loss_agg_mode` names).

    norm_constant: Dr.GRPO's constant C (e.g. the max response length), used only by
    "seq-mean-token-sum-norm". rejected_in_denominator: True keeps rejected tokens in the
    normaliser (AReaL, slime); False removes them (verl).
    """

    mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm"] = "token-mean"
    norm_constant: float = 0.0
    rejected_in_denominator: bool = True

    def __post_init__(self):
        s = "AggregationSpec"
        _check(self.mode in AGGREGATIONS, s, "mode", self.mode, f"one of {AGGREGATIONS}")
        _check(_finite(self.norm_constant) and self.norm_constant >= 0, s, "norm_constant",
               self.norm_constant, "a finite float >= 0")
        if self.mode == "seq-mean-token-sum-norm":
            _check(self.norm_constant > 0, s, "norm_constant", self.norm_constant,
                   "> 0 (e.g. the max response length) with mode 'seq-mean-token-sum-norm'")


@dataclass(frozen=True)
class KLSpec:
    """KL penalty to the reference policy as a loss term: + coef * agg(k(learner, ref)).

    estimator: "k1" (l - l_ref), "k2" (0.5 (l - l_ref)^2), "k3" (exp(x) - x - 1, x = l_ref - l),
    "k3_plus" (value of k3, gradient of k2). coef 0 turns the term off and needs no ref recompute.
    """

    estimator: Literal["k1", "k2", "k3", "k3_plus"] = "k3"
    coef: float = 0.0

    def __post_init__(self):
        s = "KLSpec"
        est = ("k1", "k2", "k3", "k3_plus")
        _check(self.estimator in est, s, "estimator", self.estimator, f"one of {est}")
        _check(_finite(self.coef) and self.coef >= 0, s, "coef", self.coef, "a finite float >= 0")


@dataclass(frozen=True)
class LossSpec:
    """The whole loss: surrogate x correction x aggregation, plus KL and entropy terms.

    total = agg(keep * w * surrogate) + kl.coef * agg(k(learner, ref)) - entropy_coef * agg(H).
    staleness_bins: number of bins of the staleness histogram metric (last bin = ">= bins - 1").
    log_entropy: compute the per-token entropy in the learner's chunked log-prob pass even when
    entropy_coef is 0, for the `entropy` metric (cost: experiments/entropy_cost.py); when False
    and entropy_coef is 0 the metric is NaN (not measured), never a made-up 0.
    """

    surrogate: SurrogateSpec = field(default_factory=SurrogateSpec)
    correction: CorrectionSpec = field(default_factory=CorrectionSpec)
    aggregation: AggregationSpec = field(default_factory=AggregationSpec)
    kl: KLSpec = field(default_factory=KLSpec)
    entropy_coef: float = 0.0
    staleness_bins: int = 8
    log_entropy: bool = True

    def __post_init__(self):
        s = "LossSpec"
        for name, cls in (("surrogate", SurrogateSpec), ("correction", CorrectionSpec),
                          ("aggregation", AggregationSpec), ("kl", KLSpec)):
            _check(isinstance(getattr(self, name), cls), s, name, getattr(self, name),
                   f"a {cls.__name__}")
        _check(_finite(self.entropy_coef), s, "entropy_coef", self.entropy_coef, "a finite float")
        _check(isinstance(self.log_entropy, bool), s, "log_entropy", self.log_entropy, "a bool")
        _check(isinstance(self.staleness_bins, int) and not isinstance(self.staleness_bins, bool)
               and self.staleness_bins >= 1, s, "staleness_bins", self.staleness_bins,
               "an int >= 1")
        c = self.correction
        if (c.old == "behaviour" and c.has_behaviour_weight
                and self.surrogate.kind in RATIO_SURROGATES):
            weights = [f"is_level={c.is_level!r}"] if c.is_level != "none" else []
            weights += [name for name in ("vtrace", "topr") if getattr(c, name)]
            _fail(s, "correction.old", c.old,
                  f"'prox' when a pi/mu weight is on ({', '.join(weights)}) with "
                  f"surrogate.kind={self.surrogate.kind!r}: in bypass mode the ratio already "
                  f"compares against mu, so the weight would count twice (or use "
                  f"surrogate.kind='reinforce')")

    @property
    def needs_prox(self) -> bool:
        """The learner must recompute `prox_logp` before the update (with the current weights,
        or with their EWMA when `needs_ewma`)."""
        return self.correction.old in ("prox", "ewma")

    @property
    def needs_ewma(self) -> bool:
        """The learner must keep an EWMA of its weights (decay `correction.ewma_decay`)."""
        return self.correction.old == "ewma"

    @property
    def needs_ref(self) -> bool:
        """The learner must compute `ref_logp` with the reference model."""
        return self.kl.coef > 0

    @property
    def needs_entropy(self) -> bool:
        """The learner must pass per-token `entropy` of the learner policy (from the logits)."""
        return self.entropy_coef != 0 or self.log_entropy
