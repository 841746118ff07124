"""Learning-rate schedules and the clipped AdamW against closed forms."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.learner.optim import make_optimizer, make_schedule, optimizer_from_config


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_schedule_closed_forms(schedule):
    lr, warm, total, r = 0.1, 4, 24, 0.1
    f = make_schedule(lr=lr, warmup_steps=warm, schedule=schedule, total_steps=total,
                      min_lr_ratio=r)
    # linear warmup that already moves on the first update
    np.testing.assert_allclose([float(f(s)) for s in range(warm)],
                               [lr * (s + 1) / warm for s in range(warm)], rtol=1e-6)
    mid = warm + (total - warm) // 2
    expected_mid = {"constant": lr, "linear": lr * (1 - (1 - r) * 0.5),
                    "cosine": lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * 0.5)))}[schedule]
    expected_end = lr if schedule == "constant" else lr * r
    np.testing.assert_allclose(float(f(warm)), lr, rtol=1e-6)
    np.testing.assert_allclose(float(f(mid)), expected_mid, rtol=1e-6)
    np.testing.assert_allclose(float(f(total)), expected_end, rtol=1e-6)
    np.testing.assert_allclose(float(f(total + 100)), expected_end, rtol=1e-6)


def test_schedule_rejects_bad_settings_naming_the_field():
    with pytest.raises(ValueError, match="optimizer.schedule must be one of"):
        make_schedule(lr=1.0, schedule="exponential")
    with pytest.raises(ValueError, match="total_steps > warmup_steps"):
        make_schedule(lr=1.0, schedule="cosine", warmup_steps=10, total_steps=10)
    with pytest.raises(ValueError, match="optimizer.min_lr_ratio"):
        make_schedule(lr=1.0, min_lr_ratio=1.5)


def test_clipped_adamw_first_update_closed_form():
    lr, wd, b1, b2, eps, clip = 0.1, 0.5, 0.9, 0.99, 1.0, 1.0
    tx, _ = make_optimizer(lr=lr, weight_decay=wd, b1=b1, b2=b2, eps=eps, grad_clip=clip)
    params = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([1.0, 1.0])}
    grads = {"w": jnp.array([[3.0, 0.0], [0.0, 4.0]]), "b": jnp.array([0.0, 0.0])}  # norm 5
    updates, _ = tx.update(grads, tx.init(params), params)
    g = np.array([[3.0, 0.0], [0.0, 4.0]]) / 5.0          # clipped to global norm 1
    m_hat, v_hat = g, g * g                               # bias-corrected first moments
    adam = m_hat / (np.sqrt(v_hat) + eps)
    expected_w = -lr * (adam + wd * np.array([[1.0, -2.0], [0.5, 3.0]]))
    np.testing.assert_allclose(np.asarray(updates["w"]), expected_w, rtol=1e-6)
    # vectors (biases, norms) are not decayed
    np.testing.assert_allclose(np.asarray(updates["b"]), 0.0, atol=1e-7)


def test_without_clipping_large_gradients_pass_through():
    tx, _ = make_optimizer(lr=1.0, eps=1.0, grad_clip=0)
    params = {"w": jnp.zeros((1, 1))}
    updates, _ = tx.update({"w": jnp.full((1, 1), 3.0)}, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["w"]), -3.0 / 4.0, rtol=1e-5)


def test_optimizer_from_config_reads_the_section():
    class Section:
        lr, weight_decay, b1, b2, eps, grad_clip = 2.0, 0.0, 0.9, 0.999, 1e-8, 1.0
        warmup_steps, schedule, min_lr_ratio = 2, "linear", 0.0
    _, sched = optimizer_from_config(Section(), total_steps=6)
    np.testing.assert_allclose([float(sched(s)) for s in range(7)],
                               [1.0, 2.0, 2.0, 1.5, 1.0, 0.5, 0.0], rtol=1e-6)
    _, sched = optimizer_from_config(Section(), total_steps=6, lr=4.0)
    np.testing.assert_allclose(float(sched(2)), 4.0)


def test_schedule_numbers_live_in_the_state_one_program_for_every_run_length():
    """run.steps, lr and the warm-up are arrays in the optimizer state (`ScheduleState`): the
    lowered update is the same program for other values (a warm persistent compilation cache
    hits), and its updates equal optax.adamw's on the closure schedule."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from laminar_jax.learner.optim import logged_lr

    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.arange(4.0)}
    grads = jax.tree.map(lambda p: jnp.cos(p) + 0.3, params)

    def lowered(**kw):
        tx, _ = make_optimizer(grad_clip=1.0, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.1, **kw)
        return jax.jit(tx.update).lower(grads, tx.init(params), params).as_text()
    base = lowered(lr=3e-4, total_steps=60, warmup_steps=2)
    assert base == lowered(lr=1e-3, total_steps=61, warmup_steps=5)

    kw = dict(lr=3e-3, warmup_steps=2, schedule="cosine", total_steps=7, min_lr_ratio=0.1)
    tx, sched = make_optimizer(grad_clip=0, weight_decay=0.1, **kw)
    ref = optax.adamw(make_schedule(**kw), weight_decay=0.1, mask=lambda t: jax.tree.map(lambda p: p.ndim >= 2, t))
    s, r, p, q = tx.init(params), ref.init(params), params, params
    for i in range(8):
        assert np.isclose(float(logged_lr(sched, s, i)), float(sched(i)), rtol=1e-6)
        u, s = tx.update(grads, s, p)
        v, r = ref.update(grads, r, q)
        p, q = optax.apply_updates(p, u), optax.apply_updates(q, v)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), p, q)
