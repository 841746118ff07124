"""Advantage estimators for outcome-reward LLM RL, as pure JAX functions.

Group-relative estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline) take one scalar reward per
sequence, `group_ids: int [B]` (arbitrary ids in [0, num_groups), groups of any size) and
`valid: bool [B]`; invalid (padding) sequences get advantage 0 and never enter a statistic.
Token-level estimators (REINFORCE++, GAE) take `[B, T]` arrays and a response mask; tokens with
mask 0 (prompt, padding, tool output) are skipped by the recursions, carrying the running value
across them, and get advantage 0. Batch whitening uses mean and unbiased variance over all valid
tokens of the batch, as verl's `masked_whiten`.

`advantages_from_spec` is the single entry point the learner uses: it applies overlong shaping
and the dynamic-sampling filter (`reward_shaping.py`), runs the chosen estimator and returns
`[B, T]` advantages with one fixed set of metric keys.
"""
from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp

from laminar_jax.rl.reward_shaping import (as_float, check_group_inputs, dynamic_sampling_filter,
                                           group_moments, overlong_penalty, safe_group_ids)

Array = chex.Array

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


def grpo_advantages(rewards: Array, group_ids: Array, valid: Array, *, num_groups: int,
                    eps: float = 1e-6, scale_by_std: bool = True) -> tuple[Array, dict[str, Array]]:
    """GRPO group-normalised advantage (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300).

        A_i = (R_i - mean_g(i)) / (std_g(i) + eps)      std: unbiased (n-1), as verl and TRL

    With `scale_by_std=False` this is Dr.GRPO, A_i = R_i - mean_g(i) (Liu et al. 2025,
    arXiv 2503.20783). A group with one valid sequence uses mean 0 and std 1, as verl
    (`compute_grpo_outcome_advantage`): A_i = R_i / (1 + eps) (GRPO) or R_i (Dr.GRPO).
    A constant group of two or more gets 0.

    Returns `(advantages [B], metrics)`; metrics: `zero_std_group_frac` (non-empty groups whose
    rewards are all equal, singletons included).
    """
    check_group_inputs("grpo_advantages", rewards=rewards, group_ids=group_ids, valid=valid,
                       num_groups=num_groups)
    count, mean, std = group_moments(rewards, group_ids, valid, num_groups=num_groups)
    valid = jnp.asarray(valid).astype(bool)
    ids = safe_group_ids(group_ids, valid)
    single = count[ids] <= 1.0
    centred = as_float(rewards) - jnp.where(single, 0.0, mean[ids])
    if scale_by_std:
        centred = centred / (jnp.where(single, 1.0, std[ids]) + eps)
    adv = jnp.where(valid, centred, 0.0)
    present = count > 0
    zero_std = present & ((count <= 1.0) | (std == 0.0))
    metrics = {"zero_std_group_frac": zero_std.sum() / jnp.maximum(present.sum(), 1)}
    return adv, metrics


def dr_grpo_advantages(rewards: Array, group_ids: Array, valid: Array, *,
                       num_groups: int) -> tuple[Array, dict[str, Array]]:
    """Dr.GRPO (Liu et al. 2025, arXiv 2503.20783): A_i = R_i - mean_g(i), no std scaling.

    Singletons use mean 0 (A_i = R_i), as verl with `norm_adv_by_std_in_grpo=False`.
    """
    return grpo_advantages(rewards, group_ids, valid, num_groups=num_groups, scale_by_std=False)


def rloo_advantages(rewards: Array, group_ids: Array, valid: Array, *,
                    num_groups: int) -> tuple[Array, dict[str, Array]]:
    """RLOO leave-one-out baseline (Ahmadian et al. 2024, arXiv 2402.14740).

        A_i = R_i - (1/(n-1)) sum_{j in g(i), j != i} R_j = n/(n-1) * (R_i - mean_g(i))

    A group with one valid sequence has no other sample to form a baseline; we return A_i = 0
    (it contributes no gradient), as verl's vectorised RLOO; verl's loop version returns the raw
    R_i instead.
    """
    check_group_inputs("rloo_advantages", rewards=rewards, group_ids=group_ids, valid=valid,
                       num_groups=num_groups)
    count, mean, _ = group_moments(rewards, group_ids, valid, num_groups=num_groups)
    valid = jnp.asarray(valid).astype(bool)
    ids = safe_group_ids(group_ids, valid)
    n = count[ids]
    scale = jnp.where(n > 1.0, n / jnp.maximum(n - 1.0, 1.0), 0.0)
    adv = jnp.where(valid, scale * (as_float(rewards) - mean[ids]), 0.0)
    present = count > 0
    metrics = {"singleton_group_frac": (present & (count <= 1.0)).sum()
               / jnp.maximum(present.sum(), 1)}
    return adv, metrics


def _check_tokens(where: str, mask: Array, *arrays: tuple[str, Array]) -> Array:
    chex.assert_rank(mask, 2, custom_message=f"{where}: response_mask must be [B, T]",
                     exception_type=ValueError)
    for name, x in arrays:
        chex.assert_shape(x, mask.shape, custom_message=f"{where}: {name} must be [B, T] like "
                          "response_mask", exception_type=ValueError)
    return jnp.asarray(mask).astype(bool)


def masked_whiten(x: Array, mask: Array, *, eps: float = 1e-8) -> Array:
    """(x - mean) / sqrt(var + eps) over the masked entries; masked-out entries become 0.

    Mean and unbiased variance (n-1) over all entries with mask 1, as verl `masked_whiten`. With
    a single masked entry the variance is taken as 0.
    """
    mask = jnp.asarray(mask).astype(bool)
    x = jnp.where(mask, as_float(x), 0.0)
    n = mask.sum()
    mean = x.sum() / jnp.maximum(n, 1)
    centred = jnp.where(mask, x - mean, 0.0)
    var = (centred * centred).sum() / jnp.maximum(n - 1, 1)
    return jnp.where(mask, centred * jax.lax.rsqrt(var + eps), 0.0)


def place_at_last_token(rewards: Array, response_mask: Array) -> Array:
    """Puts each sequence reward on its last response token: r_{i,t} = R_i * [t = last_i]."""
    mask = _check_tokens("place_at_last_token", response_mask)
    chex.assert_shape(rewards, mask.shape[:1], custom_message="place_at_last_token: rewards "
                      "must be [B]", exception_type=ValueError)
    tokens_from_here = jnp.flip(jnp.cumsum(jnp.flip(mask.astype(jnp.int32), -1), -1), -1)
    is_last = mask & (tokens_from_here == 1)
    return jnp.where(is_last, as_float(rewards)[:, None], 0.0)


def discounted_returns(token_rewards: Array, response_mask: Array, *, gamma: float) -> Array:
    """Ret_t = r_t + gamma * Ret_{next masked-in token after t}; 0 on masked-out tokens.

    Masked-out tokens (tool output) are skipped: they neither add reward nor discount. verl's
    REINFORCE++ instead resets the running return at a masked token, which only differs when
    the mask has holes (multi-turn).
    """
    mask = _check_tokens("discounted_returns", response_mask, ("token_rewards", token_rewards))
    r = jnp.where(mask, as_float(token_rewards), 0.0)

    def step(carry, xs):
        r_t, m_t = xs
        ret = r_t + gamma * carry
        return jnp.where(m_t, ret, carry), jnp.where(m_t, ret, 0.0)

    _, ret = jax.lax.scan(step, jnp.zeros(r.shape[:1], r.dtype), (r.T, mask.T), reverse=True)
    return ret.T


def reinforce_pp_advantages(rewards: Array, response_mask: Array, *, gamma: float = 1.0,
                            kl: Array | None = None, kl_coef: float = 0.0,
                            eps: float = 1e-8) -> tuple[Array, dict[str, Array]]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262; verl `reinforce_plus_plus`).

        r_{i,t}   = R_i [t = last_i] - kl_coef * KL_{i,t}
        Ret_{i,t} = sum_{s >= t, masked in} gamma^(#masked-in tokens in (t, s]) r_{i,s}
        A         = (Ret - mean) / sqrt(var + eps)    over all masked-in tokens of the batch

    Long responses weigh more in the whitening statistics (token-level mean). Padding sequences
    must have an all-zero `response_mask` row.

    Returns `(advantages [B, T], metrics)`; metrics: `return_mean`, `return_std` (before
    whitening, over masked-in tokens; the unbiased std, the one the whitening divides by).
    """
    mask = _check_tokens("reinforce_pp_advantages", response_mask)
    token_rewards = place_at_last_token(rewards, mask)
    if kl is not None:
        _check_tokens("reinforce_pp_advantages", mask, ("kl", kl))
        token_rewards = token_rewards - kl_coef * jnp.where(mask, as_float(kl), 0.0)
    ret = discounted_returns(token_rewards, mask, gamma=gamma)
    return masked_whiten(ret, mask, eps=eps), _moments("return", ret, mask, unbiased=True)


def reinforce_pp_baseline_advantages(rewards: Array, group_ids: Array, valid: Array,
                                     response_mask: Array, *, num_groups: int,
                                     eps: float = 1e-8) -> tuple[Array, dict[str, Array]]:
    """REINFORCE++-baseline (Hu 2025, arXiv 2501.03262; verl `reinforce_plus_plus_baseline`).

        A_{i,t} = whiten(R_i - mean_g(i)) over all valid response tokens of the batch

    Singletons use mean 0, as verl. Tokens of invalid sequences are 0 and excluded.
    """
    dr, metrics = dr_grpo_advantages(rewards, group_ids, valid, num_groups=num_groups)
    mask = _check_tokens("reinforce_pp_baseline_advantages", response_mask)
    mask = mask & jnp.asarray(valid).astype(bool)[:, None]
    return masked_whiten(jnp.broadcast_to(dr[:, None], mask.shape), mask, eps=eps), metrics


def gae_advantages(token_rewards: Array, values: Array, response_mask: Array, *,
                   gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
                   eps: float = 1e-8) -> tuple[tuple[Array, Array], dict[str, Array]]:
    """Generalised advantage estimation (Schulman et al. 2015, arXiv 1506.02438).

        delta_t = r_t + gamma V_{t'} - V_t,   A_t = delta_t + gamma lam A_{t'},   Ret_t = A_t + V_t

    where t' is the next masked-in token after t (V and A after the last one are 0). Masked-out
    tokens are skipped and carry the running value and advantage, as verl's
    `compute_gae_advantage_return`; rewards on them are ignored. Returns are built from the
    un-whitened advantages; with `whiten` the advantages are then whitened over the batch tokens.

    Returns `((advantages [B, T], returns [B, T]), metrics)`, both 0 on masked-out tokens;
    metrics: `return_mean`, `return_std`.
    """
    mask = _check_tokens("gae_advantages", response_mask, ("token_rewards", token_rewards),
                         ("values", values))
    r = jnp.where(mask, as_float(token_rewards), 0.0)
    v = jnp.where(mask, as_float(values), 0.0)

    def step(carry, xs):
        next_v, next_a = carry
        r_t, v_t, m_t = xs
        a = r_t + gamma * next_v - v_t + gamma * lam * next_a
        return (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a, next_a)), jnp.where(m_t, a, 0.0)

    zeros = jnp.zeros(r.shape[:1], r.dtype)
    _, adv = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, mask.T), reverse=True)
    adv = adv.T
    returns = jnp.where(mask, adv + v, 0.0)
    if whiten:
        adv = masked_whiten(adv, mask, eps=eps)
    return (adv, returns), _moments("return", returns, mask)


def _moments(prefix: str, x: Array, mask: Array, *, unbiased: bool = False) -> dict[str, Array]:
    """Masked mean and std; `unbiased` divides by n - 1 (as `masked_whiten`), else by n."""
    n = jnp.maximum(mask.sum(), 1)
    x = jnp.where(mask, x, 0.0)
    mean = x.sum() / n
    dof = jnp.maximum(n - 1, 1) if unbiased else n
    var = jnp.where(mask, (x - mean) ** 2, 0.0).sum() / dof
    return {f"{prefix}_mean": mean, f"{prefix}_std": jnp.sqrt(var)}


def advantages_from_spec(spec: Any, *, rewards: Array, group_ids: Array, valid: Array,
                         response_mask: Array, num_groups: int,
                         response_lengths: Array | None = None,
                         filter_values: Array | None = None, kl: Array | None = None,
                         kl_coef: float = 0.0,
                         whiten_eps: float = 1e-8) -> tuple[Array, dict[str, Array]]:
    """Per-token advantages `[B, T]` for the estimator an `AdvantageSpec` names.

    Steps: (1) if `spec.overlong_max_len > 0`, add `overlong_penalty(length, max_len=
    spec.overlong_max_len, buffer=spec.overlong_buffer, penalty_factor=spec.overlong_penalty)`
    to `rewards`; (2) if `spec.dynamic_sampling`, drop groups whose `filter_values` (default: the
    un-shaped `rewards`) are constant: their sequences are treated as invalid, get advantage 0
    and leave every statistic; (3) run `spec.estimator`; sequence advantages are broadcast over
    the response tokens; tokens outside `response_mask` (or of invalid/dropped sequences) are 0.

    `spec.eps` is the GRPO std epsilon. REINFORCE++ and REINFORCE++-baseline whiten with
    `sqrt(var + whiten_eps)` (1e-8, as the paper and verl) and use `spec.gamma` (REINFORCE++
    only) and the optional per-token `kl` penalty with `kl_coef`. `response_lengths` defaults to
    `response_mask.sum(-1)`; pass the full generated length when the mask has tool-token holes.

    A caller that wants dropped sequences out of its loss normaliser as well should mask them
    with `dynamic_sampling_filter` (the same call this function makes).

    Metrics (same keys for every estimator; token statistics over the tokens that receive an
    advantage): `adv_mean`, `adv_std`, `adv_min`, `adv_max`, `reward_mean`, `reward_std`
    (shaped rewards, valid sequences), `zero_std_group_frac`, `kept_seq_frac`, `kept_group_frac`
    (1 when the filter is off), `overlong_frac`, `overlong_penalty_mean` (0 when off),
    `num_seqs`, `num_tokens` (after the filter).
    """
    estimator = spec.estimator
    if estimator not in ESTIMATORS:
        raise ValueError(f"AdvantageSpec.estimator: unknown estimator {estimator!r}, expected one "
                         f"of {ESTIMATORS}")
    check_group_inputs("advantages_from_spec", rewards=rewards, group_ids=group_ids, valid=valid,
                       num_groups=num_groups)
    mask = _check_tokens("advantages_from_spec", response_mask)
    valid = jnp.asarray(valid).astype(bool)
    rewards = jnp.where(valid, as_float(rewards), 0.0)
    metrics: dict[str, Array] = {}

    if spec.overlong_max_len > 0:
        lengths = mask.sum(-1) if response_lengths is None else response_lengths
        penalty, m = overlong_penalty(lengths, valid, max_len=spec.overlong_max_len,
                                      buffer=spec.overlong_buffer,
                                      penalty_factor=spec.overlong_penalty)
        shaped = rewards + penalty
    else:
        shaped, m = rewards, {"overlong_frac": jnp.zeros(()), "overlong_penalty_mean":
                              jnp.zeros(())}
    metrics.update(m)

    if spec.dynamic_sampling:
        fv = rewards if filter_values is None else jnp.where(valid, as_float(filter_values), 0.0)
        (keep, _), m = dynamic_sampling_filter(fv, group_ids, valid, num_groups=num_groups)
        metrics.update(kept_seq_frac=m["kept_seq_frac"], kept_group_frac=m["kept_group_frac"])
    else:
        keep = valid
        metrics.update(kept_seq_frac=jnp.ones(()), kept_group_frac=jnp.ones(()))

    # Zero-spread groups of the rewards the estimator sees, before filtering (as TRL logs it).
    _, gm = grpo_advantages(shaped, group_ids, valid, num_groups=num_groups)
    metrics["zero_std_group_frac"] = gm["zero_std_group_frac"]
    metrics.update(_moments("reward", shaped, valid))

    token_mask = mask & keep[:, None]
    if estimator in ("grpo", "dr_grpo", "rloo"):
        if estimator == "rloo":
            seq_adv, _ = rloo_advantages(shaped, group_ids, keep, num_groups=num_groups)
        else:
            seq_adv, _ = grpo_advantages(shaped, group_ids, keep, num_groups=num_groups,
                                         eps=spec.eps, scale_by_std=estimator == "grpo")
        adv = jnp.where(token_mask, seq_adv[:, None], 0.0)
    elif estimator == "reinforce_pp":
        adv, _ = reinforce_pp_advantages(shaped, token_mask, gamma=spec.gamma, kl=kl,
                                         kl_coef=kl_coef, eps=whiten_eps)
    else:
        adv, _ = reinforce_pp_baseline_advantages(shaped, group_ids, keep, token_mask,
                                                  num_groups=num_groups, eps=whiten_eps)

    n_tok = token_mask.sum()
    a = _moments("adv", adv, token_mask)
    metrics.update(
        adv_mean=a["adv_mean"], adv_std=a["adv_std"],
        adv_min=jnp.where(n_tok > 0, jnp.where(token_mask, adv, jnp.inf).min(), 0.0),
        adv_max=jnp.where(n_tok > 0, jnp.where(token_mask, adv, -jnp.inf).max(), 0.0),
        num_seqs=keep.sum(), num_tokens=n_tok,
    )
    return adv, metrics
