"""Sharded train step: equals the 1-device step, compiles once, accumulates exactly, stops on NaN."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import monitoring

from laminar_jax import sharding as shd
from laminar_jax.learner import logprobs as lp
from laminar_jax.learner import optim
from laminar_jax.learner import train_state as ts
from laminar_jax.learner.train_step import NonFiniteLossError, TrainStep
from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder

CFG = DecoderConfig.preset("tiny")
B, T = 16, 24


def _init_fn():
    return Decoder(CFG, rngs=nnx.Rngs(0))


def _batch(seed=0, poison=False):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    # two packed sequences per row (lengths vary by row) then padding
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
        n1, n2 = 6 + b % 5, 8 + b % 3
        seg[b, :n1], seg[b, n1:n1 + n2] = 1, 2
        pos[b, :n1], pos[b, n1:n1 + n2] = np.arange(n1), np.arange(n2)
    mask = np.asarray(lp.next_token_mask(jnp.asarray(seg)))
    return {"tokens": tokens, "positions": pos, "segment_ids": seg,
            "num_tokens": np.float32(mask.sum()), "poison": np.float32(1.0 if poison else 0.0)}


@functools.lru_cache(maxsize=None)
def _host_params():
    """Random host params in the decoder's layout (numpy: no init compilation); norms near 1."""
    rng = np.random.default_rng(1)
    abstract = ts.shard_model(_init_fn, shd.make_mesh(1, 1, 1)).abstract_params

    def draw(path, a):
        noise = rng.normal(0.0, 0.02, a.shape).astype(np.float32)
        return noise * 5 + 1 if "norm" in jax.tree_util.keystr(path) else noise
    return jax.tree_util.tree_map_with_path(draw, abstract)


def _setup(mesh):
    sm = ts.shard_model(_init_fn, mesh)
    host = _host_params()
    # eps well above fp32 noise: Adam's g / (|g| + eps) would otherwise blow the reduction-order
    # noise of near-zero gradients up to a visible update difference between meshes
    tx, sched = optim.make_optimizer(lr=3e-3, weight_decay=0.1, grad_clip=1.0, warmup_steps=1,
                                     schedule="linear", total_steps=10, eps=1e-5)

    def loss_fn(params, batch):
        logp, ent = lp.sequence_logprobs(sm.bind(params), batch["tokens"], batch["positions"],
                                         batch["segment_ids"], chunk_size=8, with_entropy=True)
        # the global normaliser makes the micro-batch sum equal the big-batch mean
        loss = -jnp.sum(logp) / batch["num_tokens"]
        loss = loss + jnp.where(batch["poison"] > 0, jnp.nan, 0.0)
        return loss, {"entropy": jnp.sum(ent) / batch["num_tokens"]}
    return sm, host, tx, sched, loss_fn


class _CompileCounter:
    """Backend compilations seen through jax.monitoring while active."""

    def __enter__(self):
        self.names = []
        monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def _listen(self, event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            self.names.append(kw.get("fun_name"))

    def __exit__(self, *exc):
        monitoring.unregister_event_duration_listener(self._listen)


@functools.lru_cache(maxsize=None)
def _run(shape, num_micro_batches, steps=2):
    """Two steps from the same params and batches; records compilations per step call."""
    mesh = shd.make_mesh(*shape)
    sm, host, tx, sched, loss_fn = _setup(mesh)
    state, shardings = ts.init_train_state(sm, ts.place_params(sm, host), tx)
    step = TrainStep(loss_fn, tx, shardings, schedule=sched, num_micro_batches=num_micro_batches)
    metrics, compiles = [], []
    for i in range(steps):
        batch = shd.shard_batch(_batch(i), mesh)
        with _CompileCounter() as counter:
            state, m = step(state, batch)
        metrics.append(m)
        compiles.append(counter.names)
    return state, metrics, sm, compiles, step, tx


@pytest.fixture(scope="module")
def reference():
    state, metrics, *_ = _run((1, 1, 1), 2)
    return jax.device_get(state.params), metrics


@pytest.mark.parametrize("shape", [(8, 1, 1), (1, 4, 2), (2, 2, 2)])
def test_sharded_step_equals_single_device_step(reference, shape):
    ref_params, ref_metrics = reference
    state, metrics, sm, compiles, step, _ = _run(shape, 2)
    for m, r in zip(metrics, ref_metrics):
        for k in ("loss", "entropy", "grad_norm", "lr"):
            np.testing.assert_allclose(m[k], r[k], rtol=2e-5, err_msg=k)
    assert metrics[1]["loss"] != metrics[0]["loss"]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=2e-6),
                 state.params, ref_params)
    # the state keeps its rule-derived shardings through the donated step
    assert jax.tree.map(lambda x: x.sharding, state.params) == sm.param_shardings
    assert int(state.step) == 2
    # the first call compiled the step; the second call, same shapes, compiled nothing
    assert "jit(step_fn)" in compiles[0]
    assert compiles[1] == [], f"second call recompiled {compiles[1]}"
    assert step.jitted(_batch(0))._cache_size() == 1


def test_opt_state_is_sharded_like_the_params():
    mesh = shd.make_mesh(2, 2, 2)
    sm, host, tx, _, _ = _setup(mesh)
    state, shardings = ts.init_train_state(sm, ts.place_params(sm, host), tx)
    adam = state.opt_state[1][0]
    for moments in (adam.mu, adam.nu):
        assert jax.tree.map(lambda x: x.sharding, moments) == sm.param_shardings
    assert adam.count.sharding.spec == jax.sharding.PartitionSpec()
    assert jax.tree.map(lambda x: x.sharding, state.opt_state) == shardings.opt_state
    # the abstract state (a checkpoint restore target) describes exactly this state
    abstract = ts.abstract_train_state(sm, tx)
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    assert jax.tree.leaves(jax.tree.map(lambda a, x: (a.shape, a.dtype, a.sharding) == (
        x.shape, x.dtype, x.sharding), abstract, state)) == [True] * len(jax.tree.leaves(state))


def test_micro_batch_accumulation_equals_big_batch():
    one, m1, *_ = _run((1, 1, 1), 1)
    two, m2, *_ = _run((1, 1, 1), 2)
    for a, b in zip(m1, m2):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-5)
        np.testing.assert_allclose(a["entropy"], b["entropy"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                                         atol=2e-6), one.params, two.params)


def test_non_finite_loss_raises_naming_the_step_and_keeps_the_state():
    mesh = shd.make_mesh(1, 1, 1)
    _, _, sm, _, step, tx = _run((1, 1, 1), 2)  # reuse its compiled step on a fresh state
    state, _ = ts.init_train_state(sm, ts.place_params(sm, _host_params()), tx)
    state, _ = step(state, shd.shard_batch(_batch(0), mesh))
    before = jax.device_get(state.params)
    with pytest.raises(NonFiniteLossError, match="learner step 1") as err:
        step(state, shd.shard_batch(_batch(1, poison=True), mesh))
    assert err.value.step == 1 and np.isnan(err.value.metrics["loss"])
    kept = err.value.state
    assert int(kept.step) == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), kept.params, before)
    # the kept state trains on normally
    kept, m = step(kept, shd.shard_batch(_batch(2), mesh))
    assert np.isfinite(m["loss"]) and int(kept.step) == 2


def test_ahead_of_time_promises_compile_once_at_the_callers_priority_and_release_unblocks():
    """A promised signature is compiled once and never counted as a call compile: a call before
    the background thread began it compiles it itself (the thread then skips it); a call while
    the thread compiles it waits for that compile. An unpromised one compiles in the call;
    `release` frees a promise whose compile never started."""
    import threading
    import time

    from laminar_jax.learner.train_step import AheadOfTime

    class Gated:   # a jit whose lowering waits for `go` (a compile in progress, for as long as needed)
        def __init__(self, fn):
            self.jitted, self.go, self.lowered = jax.jit(fn), threading.Event(), []

        def lower(self, *args):
            self.lowered.append(args[0].shape)
            self.go.wait(30)
            return self.jitted.lower(*args)

        def __call__(self, *args):
            return self.jitted(*args)

    gated = Gated(lambda x: x * 2)
    aot = AheadOfTime(gated, wait_s=30)
    gated.go.set()
    aot.reserve(jax.ShapeDtypeStruct((3,), jnp.float32))
    x = jnp.ones(3, jnp.float32)
    np.testing.assert_array_equal(aot(x), 2 * x)   # not begun: compiled by the call
    aot.precompile(jax.ShapeDtypeStruct((3,), jnp.float32))   # the background thread skips it
    assert gated.lowered == [(3,)] and aot.call_compiles == 0

    gated.go.clear()
    spec = jax.ShapeDtypeStruct((6,), jnp.float32)
    aot.reserve(spec)
    background = threading.Thread(target=aot.precompile, args=(spec,))
    background.start()
    while gated.lowered[-1] != (6,):
        time.sleep(0.01)
    out = []
    caller = threading.Thread(target=lambda: out.append(aot(jnp.ones(6, jnp.float32))))
    caller.start()
    time.sleep(0.3)
    assert caller.is_alive() and not out          # waiting for the compile in progress
    gated.go.set()
    caller.join(30)
    background.join(30)
    np.testing.assert_array_equal(out[0], 2 * np.ones(6))
    assert gated.lowered == [(3,), (6,)] and aot.call_compiles == 0

    aot(jnp.ones(4, jnp.float32))                  # never promised: compiles in the call
    assert aot.call_compiles == 1
    aot.reserve(jax.ShapeDtypeStruct((5,), jnp.float32))
    aot.release()                                  # the thread died before compiling it
    aot(jnp.ones(5, jnp.float32))
    assert aot.call_compiles == 2
