"""Rewards: built-ins (exact match, math answers, format tags, task rules) and user functions
named by import path; `score` reports every failure as a `RewardError` record."""
from laminar_jax.rewards.builtin import exact_match, has_tags
from laminar_jax.rewards.math import extract_answer, last_boxed, math_equal, math_verify_available
from laminar_jax.rewards.registry import (BUILTIN_REWARDS, Reward, RewardError, RewardResult, RewardScorer,
                                          RewardSpecError, resolve_reward, score)

__all__ = [
    "BUILTIN_REWARDS", "Reward", "RewardError", "RewardResult", "RewardScorer", "RewardSpecError",
    "exact_match", "extract_answer", "has_tags", "last_boxed", "math_equal", "math_verify_available",
    "resolve_reward", "score",
]
