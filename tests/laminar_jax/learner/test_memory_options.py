"""The learner's memory options keep the maths and cut compiled memory (experiments/memory_plan.py
shows them at 32B): `optimizer.state_dtype` (Adam moments in bf16) and `learner.mlp_chunk`
(the MLP over sequence chunks)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from laminar_jax import sharding as shd
from laminar_jax.learner import optim
from laminar_jax.learner import train_state as ts
from laminar_jax.learner.logprobs import sequence_logprobs
from laminar_jax.models import layers as L
from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder

CFG = dataclasses.replace(DecoderConfig.preset("tiny"), intermediate_size=512)


def _batch(b=8, t=48, seed=0):
    """Two packed segments per row, then padding (ragged lengths)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32)
    seg, pos = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    for r in range(b):
        n1, n2 = 10 + r % 7, 20 + r % 5
        seg[r, :n1], seg[r, n1:n1 + n2] = 1, 2
        pos[r, :n1], pos[r, n1:n1 + n2] = np.arange(n1), np.arange(n2)
    return {"tokens": tokens, "positions": pos, "segment_ids": seg}


def _host_params(sm, seed=1):
    rng = np.random.default_rng(seed)

    def draw(path, a):
        noise = rng.normal(0.0, 0.02, a.shape).astype(np.float32)
        return noise * 5 + 1 if "norm" in jax.tree_util.keystr(path) else noise
    return jax.tree_util.tree_map_with_path(draw, sm.abstract_params)


def _loss_fn(sm):
    def loss(params, batch):
        logp, ent = sequence_logprobs(sm.bind(params), batch["tokens"], batch["positions"],
                                      batch["segment_ids"], chunk_size=16, with_entropy=True)
        return -jnp.sum(logp) / 400.0 + 0.01 * jnp.sum(ent) / 400.0, {}
    return loss


# ------------------------------------------------------------------ optimizer.state_dtype

def test_bf16_moments_are_adam_closed_form_and_track_fp32_updates():
    """The bf16-state Adam is Adam (closed form of the first update: u = -lr g / (|g| + eps), to
    bf16's rounding of the moments),
    keeps both moments in bf16, and over 5 steps of the same gradients stays within bf16's
    rounding of the fp32-state optimizer (relative 1e-2 of the parameter change)."""
    g0 = {"w": jnp.asarray([[3.0, -0.5], [1e-3, 2.0]])}
    txs = {dt: optim.make_optimizer(lr=0.1, grad_clip=0.0, state_dtype=dt, eps=1e-8)[0]
           for dt in optim.STATE_DTYPES}
    p = {"w": jnp.zeros((2, 2))}
    first, _ = txs["bfloat16"].update(g0, txs["bfloat16"].init(p), p)
    # mu_1 = (1 - b1) g and nu_1 = (1 - b2) g^2, each rounded to bf16 (relative 2^-8)
    np.testing.assert_allclose(first["w"], -0.1 * np.sign(g0["w"]), rtol=2 ** -7)
    rng = np.random.default_rng(0)
    grads = [{"w": jnp.asarray(rng.normal(size=(2, 2)), jnp.float32)} for _ in range(5)]
    out = {}
    for dt, tx in txs.items():
        params, state = p, tx.init(p)
        update = jax.jit(tx.update)
        for g in grads:
            u, state = update(g, state, params)
            params = optax.apply_updates(params, u)
        adam = state[0][0]  # chain(chain(adam, decay, schedule)): no clipping
        assert {str(x.dtype) for x in (adam.mu["w"], adam.nu["w"])} == {dt}
        out[dt] = np.asarray(params["w"])
    np.testing.assert_allclose(out["bfloat16"], out["float32"], rtol=1e-2, atol=1e-3)
    assert not np.array_equal(out["bfloat16"], out["float32"])  # bf16 rounding is really there


def test_bf16_moments_halve_the_compiled_updates_optimizer_state():
    """The optimizer update compiled for the tiny decoder's params on an fsdp-2 mesh (fake CPU
    devices): its argument bytes drop by exactly the moments' fp32 -> bf16 saving (2 moments x
    2 bytes x params per device); nothing else changes size."""
    mesh = shd.make_mesh(1, 2, 1, devices=jax.devices()[:2])
    sm = ts.shard_model(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), mesh)
    args = {}
    for dt in optim.STATE_DTYPES:
        tx, _ = optim.make_optimizer(lr=1e-3, grad_clip=1.0, state_dtype=dt)
        state = ts.abstract_train_state(sm, tx)
        update = jax.jit(tx.update, in_shardings=(sm.param_shardings, ts.opt_state_shardings(tx, sm),
                                                  sm.param_shardings))
        mem = update.lower(state.params, state.opt_state, state.params).compile().memory_analysis()
        args[dt] = mem.argument_size_in_bytes
    per_device_params = sum(int(np.prod(a.sharding.shard_shape(a.shape))) for a in jax.tree.leaves(sm.abstract_params))
    assert args["float32"] - args["bfloat16"] == 2 * 2 * per_device_params


def test_state_dtype_rejects_an_unknown_dtype_naming_the_key():
    with pytest.raises(ValueError, match=r"optimizer.state_dtype must be one of \('float32', 'bfloat16'\), got 'fp8'"):
        optim.make_optimizer(lr=1.0, state_dtype="fp8")


# ------------------------------------------------------------------ learner.mlp_chunk

def test_chunked_mlp_equals_the_whole_sequence_mlp_values_and_grads():
    """fp32: the tiled MLP (ragged T = 13, chunk 4) equals the plain one to 1e-6."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 13, 16)), jnp.float32)
    p = {k: jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32)
         for k, s in (("gate_kernel", (16, 32)), ("up_kernel", (16, 32)), ("down_kernel", (32, 16)))}
    mlp = jax.jit(L.swiglu_mlp, static_argnames="chunk")
    np.testing.assert_allclose(mlp(p, x, chunk=4), mlp(p, x, chunk=0), rtol=1e-6, atol=1e-6)
    grad = lambda c: jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(L.swiglu_mlp(p, x, chunk=c))),  # noqa: E731
                                      argnums=(0, 1)))(p, x)
    for a, b in zip(jax.tree.leaves(grad(4)), jax.tree.leaves(grad(0))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


WIDE = dataclasses.replace(CFG, intermediate_size=4096)


def _decoder_loss(mlp_chunk, remat="block"):
    sm = ts.shard_model(lambda: Decoder(WIDE, rngs=nnx.Rngs(0), remat=remat, mlp_chunk=mlp_chunk),
                        shd.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    return sm, jax.jit(jax.value_and_grad(lambda p, b: _loss_fn(sm)(p, b)[0]))


def test_mlp_chunk_keeps_the_decoders_loss_and_grads_and_cuts_its_temp_memory():
    """The whole decoder (packed rows, remat block): mlp_chunk 32 of 256 tokens gives the same loss (1e-6) and
    grads (1e-5) as no chunking, and the compiled forward+backward's temp bytes fall below 0.6x
    (at 256 tokens x 4096 intermediate the [tokens, mlp] temporaries dominate)."""
    batch = jax.device_put(_batch(b=2, t=256))
    temps, outs = {}, {}
    for chunk in (0, 32):
        sm, fn = _decoder_loss(chunk)
        params = ts.place_params(sm, _host_params(sm))
        compiled = fn.lower(params, batch).compile()
        temps[chunk] = compiled.memory_analysis().temp_size_in_bytes
        outs[chunk] = jax.device_get(compiled(params, batch))
    np.testing.assert_allclose(outs[32][0], outs[0][0], rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(outs[32][1]), jax.tree.leaves(outs[0][1])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert temps[32] < 0.6 * temps[0], temps


def test_mlp_chunk_rejects_a_negative_value_naming_the_key():
    with pytest.raises(ValueError, match=r"learner.mlp_chunk: got -1"):
        Decoder(CFG, rngs=nnx.Rngs(0), mlp_chunk=-1)
