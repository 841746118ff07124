"""Gradient accumulation inside the backward pass (`learner.train_step`, `loss_accumulates`):
the decoder's backward layer loop adds each layer's gradient into the running sum in place
(`models.decoder.scan_layers_into`), so a step holds one fp32 gradient copy instead of two
(experiments/memory_plan.py: 14.5 GiB per device for Qwen2.5-32B at fsdp 8). The maths is the
plain accumulation's; these tests check the vjp's closed form, the compiled memory, and that the
real RL train step (what `laminar train` runs) gives the plain step's update."""
import jax
import jax.numpy as jnp
import numpy as np

from laminar_jax import sharding as shd
from laminar_jax.config import load_config
from laminar_jax.learner.setup import build as build_setup
from laminar_jax.learner.train_step import accumulate_gradients
from laminar_jax.models.decoder import apply_remat
from laminar_jax.models.grad_accumulation import add_to_grad, scan_layers_into
from laminar_jax.runtime import rl_step


def _body(x, p):
    return jnp.tanh(x @ p["w"] + p["b"]), None


def _stack(rng, layers=3, e=8):
    return {"w": jnp.asarray(rng.normal(size=(layers, e, e)) * 0.5, jnp.float32),
            "b": jnp.asarray(rng.normal(size=(layers, e)), jnp.float32)}


def test_scan_layers_into_returns_the_accumulator_plus_the_block_remat_gradient():
    """vjp of scan_layers_into w.r.t. (x, params) = (d/dx, acc + d/dparams) of the plain
    remat-block scan, to fp32 rounding; its forward is the scan's."""
    rng = np.random.default_rng(0)
    params, acc = _stack(rng), _stack(rng)
    x = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)

    def plain(x, p):
        return jax.lax.scan(apply_remat(_body, "block"), x, p)[0]
    y0, vjp0 = jax.vjp(plain, x, params)
    y1, vjp1 = jax.vjp(lambda x, p: scan_layers_into(_body, x, p, acc), x, params)
    np.testing.assert_allclose(y1, y0, rtol=1e-6)
    (gx0, gp0), (gx1, gp1) = vjp0(ct), vjp1(ct)
    np.testing.assert_allclose(gx1, gx0, rtol=1e-5, atol=1e-6)
    for k in params:
        np.testing.assert_allclose(gp1[k], acc[k] + gp0[k], rtol=1e-5, atol=1e-6)
    # add_to_grad: the identity forward, acc + cotangent backward
    y2, vjp2 = jax.vjp(lambda p: add_to_grad(p, acc), params)
    (g2,) = vjp2(jax.tree.map(jnp.ones_like, params))
    for k in params:
        np.testing.assert_array_equal(y2[k], params[k])
        np.testing.assert_allclose(g2[k], acc[k] + 1.0, rtol=1e-6)


def test_in_place_accumulation_drops_one_gradient_copy_from_the_compiled_temp():
    """4 micro-batches through 8 stacked 512x512 layers (8 MiB of fp32 gradient, tiny
    activations): the plain accumulation's temp holds the micro-batch's whole gradient beside
    the sum; in place it does not (temp falls by more than 0.8 x the gradient's bytes), and the
    gradients agree."""
    layers, e, m = 8, 512, 4
    params = {"w": jax.ShapeDtypeStruct((layers, e, e), jnp.float32),
              "b": jax.ShapeDtypeStruct((layers, e), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((m * 2, e), jnp.float32)}

    def loss(p, mb, grad_acc=None):
        if grad_acc is None:
            y = jax.lax.scan(apply_remat(_body, "block"), mb["x"], p)[0]
        else:
            y = scan_layers_into(_body, mb["x"], p, grad_acc)
        return jnp.sum(y ** 2), {}
    fns = {how: jax.jit(lambda p, b, how=how: accumulate_gradients(
        loss, p, b, num_micro_batches=m, loss_accumulates=how)[2]) for how in (False, True)}
    temp = {how: f.lower(params, batch).compile().memory_analysis().temp_size_in_bytes for how, f in fns.items()}
    grad_bytes = layers * (e * e + e) * 4
    assert temp[False] - temp[True] > 0.8 * grad_bytes, (temp, grad_bytes)
    rng = np.random.default_rng(1)
    real = {"w": jnp.asarray(rng.normal(size=(layers, e, e)) / np.sqrt(e), jnp.float32),
            "b": jnp.zeros((layers, e), jnp.float32)}
    xb = {"x": jnp.asarray(rng.normal(size=(m * 2, e)), jnp.float32)}
    for a, b in zip(jax.tree.leaves(fns[True](real, xb)), jax.tree.leaves(fns[False](real, xb))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_rl_train_steps_loss_accumulates_in_place_and_equals_the_plain_accumulation():
    """`runtime.rl_step.build` (what `laminar train` runs) on an fsdp-2 mesh, remat block, 2
    micro-batches: its train step accumulates in the backward pass, and its loss's accumulated
    loss and gradients equal the plain accumulation's (fp32, 1e-6)."""
    cfg = load_config(None, ["learner.global_batch_groups=2", "data.group_size=4", "run.steps=2",
                             "mesh.data=1", "mesh.fsdp=2", "learner.micro_batch_size=4", "learner.remat=block"])
    setup = build_setup(cfg, total_steps=2)
    fns = rl_step.build(cfg, setup, mini_batch_rows=8)
    assert fns.train.loss_accumulates
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (8, 16)).astype(np.int32)
    resp = np.zeros((8, 16), np.float32)
    resp[:, 6:] = 1.0
    mb = {"tokens": tokens, "positions": np.tile(np.arange(16, dtype=np.int32), (8, 1)),
          "segment_ids": np.ones((8, 16), np.int32), "response_mask": resp,
          "behaviour_logp": np.full((8, 16), -6.0, np.float32) * resp, "staleness": np.zeros((8, 16), np.float32),
          "advantages": np.repeat(rng.normal(size=(8, 1)), 16, 1).astype(np.float32) * resp}
    inputs = shd.shard_batch(fns.inputs(setup.state.params, mb), setup.mesh)
    outs = {}
    for how in (True, False):
        outs[how] = jax.device_get(jax.jit(lambda p, b, how=how: accumulate_gradients(
            fns.loss, p, b, num_micro_batches=2, param_shardings=setup.shardings.params, mesh=setup.mesh,
            metric_reduction="mean", loss_accumulates=how))(setup.state.params, inputs))
    np.testing.assert_allclose(outs[True][0], outs[False][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(outs[True][2]), jax.tree.leaves(outs[False][2])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


def test_the_sft_loss_accumulates_in_place_and_equals_the_whole_batch_pass():
    """`laminar sft`'s loss (`learner.sft.sft_loss`, what `sft.run` trains with) on an fsdp-2
    mesh, remat block, 2 micro-batches of packed demonstrations, accumulated in the backward
    pass: the loss and gradients equal the whole batch's single pass (the normaliser is
    global), and `sft.run`'s step is built that way."""
    import inspect

    from laminar_jax.data.tasks import get_task
    from laminar_jax.learner import sft

    assert "loss_accumulates=True" in inspect.getsource(sft.run)
    cfg = load_config(None, ["mesh.data=1", "mesh.fsdp=2", "learner.remat=block"])
    setup = build_setup(cfg, total_steps=1)
    loss_fn = sft.sft_loss(setup.sharded, chunk_size=cfg.learner.logprob_chunk)
    examples = get_task("arithmetic").sft_examples(40, seed=0)
    batch, _ = sft.pack_examples(examples, np.arange(len(examples)), 0, batch_size=4, seq_len=32)
    batch = shd.shard_batch(batch, setup.mesh)
    outs = [jax.device_get(jax.jit(lambda p, b, m=m: accumulate_gradients(
        loss_fn, p, b, num_micro_batches=m, param_shardings=setup.shardings.params, mesh=setup.mesh,
        loss_accumulates=True))(setup.state.params, batch)) for m in (2, 1)]
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(outs[0][2]), jax.tree.leaves(outs[1][2])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
