"""Optimizer: AdamW with global-norm gradient clipping and a warmup/decay learning-rate schedule.

    g      <- g * min(1, grad_clip / ||g||_2)                      (global norm over all params)
    lr(s)  =  lr * min(1, (s + 1) / warmup_steps)                   for s < warmup_steps
    lr(s)  =  lr * f(p),  p = clip((s - warmup) / (total - warmup), 0, 1)   afterwards, with
              f = 1 (constant), 1 - (1 - r) p (linear), r + (1 - r)(1 + cos(pi p)) / 2 (cosine),
              r = min_lr_ratio.

AdamW (Loshchilov & Hutter, 2019) decays only matrices (rank >= 2); norms and biases are not
decayed, as in most LLM recipes. ``s`` counts optimizer updates from 0, so the first update
already uses lr / warmup_steps instead of a wasted zero-lr step.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "linear", "cosine")


def make_schedule(*, lr: float, warmup_steps: int = 0, schedule: str = "constant",
                  total_steps: int | None = None, min_lr_ratio: float = 0.0) -> optax.Schedule:
    """Learning rate as a function of the update count (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"optimizer.schedule must be one of {SCHEDULES}, got {schedule!r}")
    if warmup_steps < 0:
        raise ValueError(f"optimizer.warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optimizer.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if schedule != "constant" and (total_steps is None or total_steps <= warmup_steps):
        raise ValueError(f"optimizer.schedule={schedule!r} needs total_steps > warmup_steps "
                         f"({warmup_steps}), got total_steps={total_steps}")

    def fn(count):
        s = jnp.asarray(count, jnp.float32)
        warm = jnp.minimum(1.0, (s + 1.0) / warmup_steps) if warmup_steps else 1.0
        if schedule == "constant":
            decay = 1.0
        else:
            p = jnp.clip((s - warmup_steps) / (total_steps - warmup_steps), 0.0, 1.0)
            if schedule == "linear":
                decay = 1.0 - (1.0 - min_lr_ratio) * p
            else:
                decay = min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * p))
        return lr * warm * decay
    return fn


def decay_mask(params: Any) -> Any:
    """True for params that get weight decay: every array of rank >= 2."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(*, lr: float, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, grad_clip: float | None = 1.0, warmup_steps: int = 0,
                   schedule: str = "constant", total_steps: int | None = None,
                   min_lr_ratio: float = 0.0) -> tuple[optax.GradientTransformation,
                                                       optax.Schedule]:
    """``clip_by_global_norm(grad_clip)`` then AdamW on ``make_schedule(...)``.

    ``grad_clip`` of ``None`` or ``0`` turns clipping off. Returns ``(tx, schedule)`` so the train
    step can log the learning rate it used.
    """
    if lr <= 0:
        raise ValueError(f"optimizer.lr must be > 0, got {lr}")
    if grad_clip is not None and grad_clip < 0:
        raise ValueError(f"optimizer.grad_clip must be >= 0 (0 = off), got {grad_clip}")
    sched = make_schedule(lr=lr, warmup_steps=warmup_steps, schedule=schedule,
                          total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
    parts.append(optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                             mask=decay_mask))
    return optax.chain(*parts), sched


def optimizer_from_config(section: Any, *, total_steps: int | None = None,
                          lr: float | None = None) -> tuple[optax.GradientTransformation,
                                                            optax.Schedule]:
    """``make_optimizer`` from a config section (``lr, weight_decay, b1, b2, eps, grad_clip,
    warmup_steps, schedule, min_lr_ratio``); ``lr`` overrides the section's value."""
    g = lambda name, default: getattr(section, name, default)  # noqa: E731
    return make_optimizer(lr=lr if lr is not None else g("lr", 1e-5),
                          weight_decay=g("weight_decay", 0.0), b1=g("b1", 0.9), b2=g("b2", 0.999),
                          eps=g("eps", 1e-8), grad_clip=g("grad_clip", 1.0),
                          warmup_steps=g("warmup_steps", 0), schedule=g("schedule", "constant"),
                          total_steps=total_steps, min_lr_ratio=g("min_lr_ratio", 0.0))
