"""Optimizer: AdamW with global-norm gradient clipping and a warmup/decay learning-rate schedule.

    g      <- g * min(1, grad_clip / ||g||_2)                      (global norm over all params)
    lr(s)  =  lr * min(1, (s + 1) / warmup_steps)                   for s < warmup_steps
    lr(s)  =  lr * f(p),  p = clip((s - warmup) / (total - warmup), 0, 1)   afterwards, with
              f = 1 (constant), 1 - (1 - r) p (linear), r + (1 - r)(1 + cos(pi p)) / 2 (cosine),
              r = min_lr_ratio.

Adam's moments are kept in ``state_dtype`` (``optimizer.state_dtype``): float32, or bfloat16 to
halve the optimizer state (2 x 4 -> 2 x 2 bytes per param; the largest argument of a 32B step on
paper, experiments/memory_plan.py). The update itself is computed in float32 from the stored
moments and rounded back on store (``scale_by_adam_in``); bf16 keeps fp32's exponent range, so
nu = E[g^2] neither under- nor overflows where fp32 would not.

AdamW (Loshchilov & Hutter, 2019) decays only matrices (rank >= 2); norms and biases are not
decayed, as in most LLM recipes. ``s`` counts optimizer updates from 0, so the first update
already uses lr / warmup_steps instead of a wasted zero-lr step.

The schedule's numbers (lr, warmup_steps, total_steps, min_lr_ratio) ride in the optimizer state
(`ScheduleState`) instead of being constants of the compiled update: a run with another
`run.steps` or `sft.steps` runs the same program, so a warm persistent compilation cache serves
its learner step instead of a full compile.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

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
        return schedule_value(count, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps or 0,
                              min_lr_ratio=min_lr_ratio, schedule=schedule)
    fn.kind = schedule   # logged_lr recomputes it from the optimizer state's numbers
    return fn


def schedule_value(count, *, lr, warmup_steps, total_steps, min_lr_ratio, schedule: str):
    """The module docstring's lr(s); every argument but `schedule` may be a traced array."""
    s = jnp.asarray(count, jnp.float32)
    warmup = jnp.asarray(warmup_steps, jnp.float32)
    warm = jnp.where(warmup > 0, jnp.minimum(1.0, (s + 1.0) / jnp.maximum(warmup, 1.0)), 1.0)
    if schedule == "constant":
        decay = 1.0
    else:
        p = jnp.clip((s - warmup) / (jnp.asarray(total_steps, jnp.float32) - warmup), 0.0, 1.0)
        if schedule == "linear":
            decay = 1.0 - (1.0 - min_lr_ratio) * p
        else:
            decay = min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * p))
    return lr * warm * decay


class ScheduleState(NamedTuple):
    """`scale_by_schedule_state`'s state: the update count and the schedule's numbers as arrays,
    so that a run with another run.steps, lr or warm-up runs the same compiled step (numbers
    baked into the program as constants would change its HLO: a persistent-cache miss, a full
    compile of the learner step)."""
    count: jax.Array
    lr: jax.Array
    warmup_steps: jax.Array
    total_steps: jax.Array
    min_lr_ratio: jax.Array


def scale_by_schedule_state(*, lr: float, warmup_steps: int, total_steps: int | None, min_lr_ratio: float,
                            schedule: str) -> optax.GradientTransformation:
    """updates * -lr(count), lr(s) of the module docstring from the state's numbers; the same as
    optax's ``scale_by_learning_rate(make_schedule(...))``."""
    def init(params):
        del params
        f = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
        return ScheduleState(jnp.zeros([], jnp.int32), f(lr), f(warmup_steps), f(total_steps or 0), f(min_lr_ratio))

    def update(updates, state, params=None):
        del params
        step_lr = schedule_value(state.count, lr=state.lr, warmup_steps=state.warmup_steps,
                                 total_steps=state.total_steps, min_lr_ratio=state.min_lr_ratio, schedule=schedule)
        updates = jax.tree.map(lambda u: jnp.asarray(-step_lr, u.dtype) * u, updates)
        return updates, state._replace(count=optax.safe_int32_increment(state.count))
    return optax.GradientTransformation(init, update)


def logged_lr(schedule: optax.Schedule, opt_state: Any, count):
    """The lr of update `count`: from the optimizer state's `ScheduleState` when it has one (no
    constant in the program), else `schedule(count)`."""
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScheduleState))
             if isinstance(x, ScheduleState)]
    kind = getattr(schedule, "kind", None)
    if len(found) != 1 or kind is None:
        return schedule(count)
    st = found[0]
    return schedule_value(count, lr=st.lr, warmup_steps=st.warmup_steps, total_steps=st.total_steps,
                          min_lr_ratio=st.min_lr_ratio, schedule=kind)


STATE_DTYPES = ("float32", "bfloat16")


def scale_by_adam_in(state_dtype: str, *, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam's scaling (Kingma & Ba, 2015) with both moments stored in ``state_dtype``:

        mu_t = b1 mu_{t-1} + (1 - b1) g,   nu_t = b2 nu_{t-1} + (1 - b2) g^2      (in float32)
        u_t  = (mu_t / (1 - b1^t)) / (sqrt(nu_t / (1 - b2^t)) + eps)

    with mu_t, nu_t rounded to ``state_dtype`` before u_t reads them. float32 is ``optax.scale_by_adam`` itself (the
    same state tree either way: ``optax.ScaleByAdamState``)."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"optimizer.state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
    if state_dtype == "float32":
        return optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
    dt = jnp.dtype(state_dtype)

    def init(params):
        zeros = lambda p: jnp.zeros(p.shape, dt)  # noqa: E731
        return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), jax.tree.map(zeros, params),
                                      jax.tree.map(zeros, params))

    def update(updates, state, params=None):
        del params
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        count = optax.safe_int32_increment(state.count)
        # The update reads the stored (rounded) moments: it is the update the new state implies,
        # and no fp32 copy of a moment needs to outlive its own fused store.
        mu = jax.tree.map(lambda m, g: (b1 * f32(m) + (1 - b1) * f32(g)).astype(dt), state.mu, updates)
        nu = jax.tree.map(lambda v, g: (b2 * f32(v) + (1 - b2) * jnp.square(f32(g))).astype(dt), state.nu, updates)
        t = count.astype(jnp.float32)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        out = jax.tree.map(lambda m, v, g: ((f32(m) / c1) / (jnp.sqrt(f32(v) / c2) + eps)).astype(g.dtype),
                           mu, nu, updates)
        return out, optax.ScaleByAdamState(count, mu, nu)
    return optax.GradientTransformation(init, update)


def decay_mask(params: Any) -> Any:
    """True for params that get weight decay: every array of rank >= 2."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(*, lr: float, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, grad_clip: float | None = 1.0, warmup_steps: int = 0,
                   schedule: str = "constant", total_steps: int | None = None,
                   min_lr_ratio: float = 0.0, state_dtype: str = "float32") -> tuple[optax.GradientTransformation,
                                                                                      optax.Schedule]:
    """``clip_by_global_norm(grad_clip)`` then AdamW on ``make_schedule(...)``, the moments in
    ``state_dtype`` (``scale_by_adam_in``).

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
    # optax.adamw's chain, with the schedule's numbers in the state (ScheduleState)
    parts.append(optax.chain(scale_by_adam_in(state_dtype, b1=b1, b2=b2, eps=eps),
                             optax.add_decayed_weights(weight_decay, mask=decay_mask),
                             scale_by_schedule_state(lr=lr, warmup_steps=warmup_steps, total_steps=total_steps,
                                                     min_lr_ratio=min_lr_ratio, schedule=schedule)))
    return optax.chain(*parts), sched


def optimizer_from_config(section: Any, *, total_steps: int | None = None,
                          lr: float | None = None) -> tuple[optax.GradientTransformation,
                                                            optax.Schedule]:
    """``make_optimizer`` from a config section (``lr, weight_decay, b1, b2, eps, grad_clip,
    warmup_steps, schedule, min_lr_ratio, state_dtype``); ``lr`` overrides the section's value."""
    g = lambda name, default: getattr(section, name, default)  # noqa: E731
    return make_optimizer(lr=lr if lr is not None else g("lr", 1e-5),
                          weight_decay=g("weight_decay", 0.0), b1=g("b1", 0.9), b2=g("b2", 0.999),
                          eps=g("eps", 1e-8), grad_clip=g("grad_clip", 1.0),
                          warmup_steps=g("warmup_steps", 0), schedule=g("schedule", "constant"),
                          total_steps=total_steps, min_lr_ratio=g("min_lr_ratio", 0.0),
                          state_dtype=g("state_dtype", "float32"))
