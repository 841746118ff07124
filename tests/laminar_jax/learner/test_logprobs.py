"""Chunked log-probs / entropies against the naive full-logits computation, values and gradients."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from laminar_jax import sharding as shd
from laminar_jax.learner import train_state as ts
from laminar_jax.learner.logprobs import (chunked_token_logprobs, make_logprobs_fn,
                                          next_token_mask, sequence_logprobs)
from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder


def _naive(hidden, w, y, temperature=1.0):
    z = jnp.einsum("bth,hv->btv", hidden, w) / temperature
    logsm = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logsm, y[..., None], axis=-1)[..., 0]
    return logp, -jnp.sum(jnp.exp(logsm) * logsm, axis=-1)


def _inputs(b=3, t=13, h=16, v=50, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k1, (b, t, h)), jax.random.normal(k2, (h, v)) * 0.5,
            jax.random.randint(k3, (b, t), 0, v))


@pytest.mark.parametrize("chunk_size", [1, 4, 13, 32])
def test_chunked_matches_naive_values_and_gradients(chunk_size):
    hidden, w, y = _inputs()
    temp = 0.7
    logp, ent = jax.jit(lambda hh, ww: chunked_token_logprobs(
        hh, ww, y, chunk_size=chunk_size, temperature=temp, with_entropy=True))(hidden, w)
    ref_logp, ref_ent = jax.jit(lambda hh, ww: _naive(hh, ww, y, temp))(hidden, w)
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-5)

    # an RL-style objective: weighted log-probs plus an entropy bonus
    c = jax.random.normal(jax.random.key(7), y.shape)

    def objective(fn):
        def f(hh, ww):
            lp, e = fn(hh, ww)
            return jnp.sum(c * lp) + 0.3 * jnp.sum(e)
        return jax.jit(jax.grad(f, argnums=(0, 1)))
    g = objective(lambda hh, ww: chunked_token_logprobs(hh, ww, y, chunk_size=chunk_size,
                                                        temperature=temp, with_entropy=True))
    g_ref = objective(lambda hh, ww: _naive(hh, ww, y, temp))
    for a, b in zip(g(hidden, w), g_ref(hidden, w)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_entropy_is_optional_and_logp_is_normalised():
    hidden, w, _ = _inputs(b=1, t=2, v=7)
    # exp(logp) over every possible target sums to one
    all_targets = jnp.arange(7)[:, None].repeat(2, axis=1)            # [7, 2]
    logp, ent = chunked_token_logprobs(jnp.repeat(hidden, 7, axis=0), w, all_targets, chunk_size=1)
    assert ent is None
    np.testing.assert_allclose(jnp.exp(logp).sum(0), 1.0, rtol=1e-5)


def test_chunking_bounds_logit_memory():
    """Forward+backward never holds the full [B, T, V] fp32 logits (compiled temp memory)."""
    b, t, h, v = 4, 256, 32, 4096
    args = (jax.ShapeDtypeStruct((b, t, h), jnp.float32), jax.ShapeDtypeStruct((h, v), jnp.float32),
            jax.ShapeDtypeStruct((b, t), jnp.int32))
    full_logits = b * t * v * 4

    def temp_bytes(fn):
        def loss(hh, ww, yy):
            lp, e = fn(hh, ww, yy)
            return jnp.sum(lp) + jnp.sum(e)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes
    chunked = temp_bytes(lambda hh, ww, yy: chunked_token_logprobs(hh, ww, yy, chunk_size=32,
                                                                   with_entropy=True))
    naive = temp_bytes(_naive)
    assert naive >= full_logits
    assert chunked < 0.6 * full_logits, (chunked, full_logits)


def test_next_token_mask_marks_tokens_with_a_predecessor_in_their_segment():
    seg = jnp.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(next_token_mask(seg), [[0, 1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]])


CFG = DecoderConfig.preset("tiny")


def _init_fn():
    return Decoder(CFG, rngs=nnx.Rngs(3))


def _host_params(sm):
    """Random params in the decoder's layout, drawn with numpy (no init compilation)."""
    rng = np.random.default_rng(2)

    def draw(path, a):
        noise = rng.normal(0.0, 0.05, a.shape).astype(np.float32)
        return noise + 1 if "norm" in jax.tree_util.keystr(path) else noise
    return jax.tree_util.tree_map_with_path(draw, sm.abstract_params)


def test_packed_sequence_logprobs_equal_each_sequence_alone_and_the_naive_logits():
    rng = np.random.default_rng(0)
    lengths = [5, 9, 4, 7]
    seqs = [rng.integers(0, CFG.vocab_size, n) for n in lengths]
    prompt_len = [2, 3, 1, 4]
    # packed: sequences 0,1 in row 0 and 2,3 in row 1, then padding
    L = 16
    packed = {k: np.zeros((2, L), np.int32) for k in ("tokens", "positions", "segment_ids", "resp")}
    for row, pair in enumerate([(0, 1), (2, 3)]):
        at = 0
        for sid, i in enumerate(pair, start=1):
            n = lengths[i]
            packed["tokens"][row, at:at + n] = seqs[i]
            packed["positions"][row, at:at + n] = np.arange(n)
            packed["segment_ids"][row, at:at + n] = sid
            packed["resp"][row, at + prompt_len[i]:at + n] = 1
            at += n
    # padded: one sequence per row
    Lp = max(lengths)
    padded = {k: np.zeros((4, Lp), np.int32) for k in ("tokens", "positions", "segment_ids")}
    for i, s in enumerate(seqs):
        padded["tokens"][i, :len(s)] = s
        padded["positions"][i, :len(s)] = np.arange(len(s))
        padded["segment_ids"][i, :len(s)] = 1

    sm = ts.shard_model(_init_fn, shd.make_mesh(1, 1, 1))
    params = ts.place_params(sm, _host_params(sm))

    @jax.jit
    def run(params, packed, padded):
        model = sm.bind(params)
        lp_packed, ent_packed = sequence_logprobs(
            model, packed["tokens"], packed["positions"], packed["segment_ids"],
            response_mask=packed["resp"], chunk_size=3, with_entropy=True)
        lp_alone, _ = sequence_logprobs(model, padded["tokens"], padded["positions"],
                                        padded["segment_ids"], chunk_size=4)
        logits = model(padded["tokens"], padded["positions"], padded["segment_ids"])
        return lp_packed, ent_packed, lp_alone, logits
    lp_packed, ent_packed, lp_alone, logits = jax.device_get(run(params, packed, padded))

    logsm = jax.nn.log_softmax(logits, axis=-1)
    for i, s in enumerate(seqs):
        n = len(s)
        # naive: log softmax of the full logits at t-1, read at token t
        naive = np.asarray([logsm[i, t - 1, s[t]] for t in range(1, n)])
        np.testing.assert_allclose(lp_alone[i, 1:n], naive, rtol=1e-4, atol=1e-5)
        assert lp_alone[i, 0] == 0 and np.all(lp_alone[i, n:] == 0)
        naive_ent = -(np.exp(logsm[i, :n - 1]) * logsm[i, :n - 1]).sum(-1)
        # packed rows: the same numbers at the response positions, zero elsewhere
        row, at = (0, 0 if i == 0 else lengths[0]) if i < 2 else (1, 0 if i == 2 else lengths[2])
        got = lp_packed[row, at:at + n]
        p = prompt_len[i]
        np.testing.assert_allclose(got[p:], naive[p - 1:], rtol=1e-4, atol=1e-5)
        assert np.all(got[:p] == 0)
        np.testing.assert_allclose(ent_packed[row, at + p:at + n], naive_ent[p - 1:], rtol=1e-4,
                                   atol=1e-5)
    assert np.all(lp_packed[0, sum(lengths[:2]):] == 0) and np.all(lp_packed[1, sum(lengths[2:]):] == 0)


def test_sharded_logprobs_fn_equals_single_device():
    rng = np.random.default_rng(1)
    b, length = 8, 12
    tokens = rng.integers(0, CFG.vocab_size, (b, length)).astype(np.int32)
    positions = np.tile(np.arange(length, dtype=np.int32), (b, 1))
    seg = np.ones((b, length), np.int32)
    seg[:, 10:] = 0
    resp = (np.arange(length) >= 4).astype(np.int32)[None].repeat(b, 0)
    out = []
    for shape in [(1, 1, 1), (2, 2, 2)]:
        mesh = shd.make_mesh(*shape)
        sm = ts.shard_model(_init_fn, mesh)
        fn = make_logprobs_fn(sm, chunk_size=5, with_entropy=True)
        params = ts.place_params(sm, _host_params(sm))
        lp, ent = fn(params, *(shd.shard_batch(x, mesh) for x in (tokens, positions, seg, resp)))
        assert lp.sharding.spec == shd.batch_spec(2)
        out.append((np.asarray(lp), np.asarray(ent)))
    np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-5, atol=1e-5)
    assert np.all(out[0][0][:, :4] == 0) and np.all(out[0][0][:, 10:] == 0)
    assert np.all(out[0][0][:, 4:10] < 0)


def _fsdp_loss(sm, shardings, chunk=32):
    def loss(params, tokens, positions, seg, coef):
        lp, ent = sequence_logprobs(sm.bind(params), tokens, positions, seg, chunk_size=chunk,
                                    with_entropy=True, shardings=shardings)
        return jnp.sum(coef * lp) + 0.1 * jnp.sum(ent)
    return jax.value_and_grad(loss)


def test_fsdp_train_shardings_split_activations_and_keep_the_maths():
    """On an fsdp-8 mesh, `ShardedModel.train_shardings()` keeps every device on its own rows.
    GSPMD left alone replicates the batch and splits activations over `embed` (what made the 7B
    preset not fit: experiments/memory_plan.py). Same loss and grads either way."""
    cfg = dataclasses.replace(CFG, intermediate_size=1024, tie_word_embeddings=False)
    b, length = 8, 64
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, cfg.vocab_size, (b, length)).astype(np.int32)
    positions = np.tile(np.arange(length, dtype=np.int32), (b, 1))
    seg = np.ones((b, length), np.int32)
    seg[:, 50:] = 0
    coef = rng.normal(size=(b, length)).astype(np.float32)
    mesh = shd.make_mesh(1, 8, 1)
    sm = ts.shard_model(lambda: Decoder(cfg, rngs=nnx.Rngs(3), remat="block"), mesh)
    params = ts.place_params(sm, _host_params(sm))
    args = [shd.shard_batch(x, mesh) for x in (tokens, positions, seg, coef)]
    temps, outs = {}, {}
    for name, shardings in (("pinned", sm.train_shardings()), ("gspmd", None)):
        fn = jax.jit(_fsdp_loss(sm, shardings), out_shardings=(shd.replicated(mesh), sm.param_shardings))
        compiled = fn.lower(params, *args).compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
        outs[name] = jax.device_get(compiled(params, *args))
    np.testing.assert_allclose(outs["pinned"][0], outs["gspmd"][0], rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(outs["pinned"][1]),
                            jax.tree.leaves(outs["gspmd"][1])):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-5, err_msg=jax.tree_util.keystr(path))
    # GSPMD left alone holds several full-batch fp32 [B, T, mlp] activations per device
    full_mlp = b * length * cfg.intermediate_size * 4
    assert temps["pinned"] * 3 < temps["gspmd"] and temps["gspmd"] > 2 * full_mlp, temps
