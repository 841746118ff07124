"""Packed batches train like unpacked ones, and the learner step compiles once per bucket."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import monitoring

from laminar_jax.config import Config, LearnerConfig, RunConfig
from laminar_jax.data.records import Trajectory
from laminar_jax.learner.setup import build as build_setup
from laminar_jax.rl.spec import AGGREGATIONS, AggregationSpec
from laminar_jax.runtime import batch as B
from laminar_jax.runtime import rl_step

GROUP = 4


def _groups(lengths, seed=0, version=3):
    r = np.random.RandomState(seed)
    out = []
    for g in range(len(lengths) // GROUP):
        group = []
        for i, (p, n) in enumerate(lengths[g * GROUP:(g + 1) * GROUP]):
            logp = -r.rand(n).astype(np.float32)
            group.append(Trajectory(f"g{g}", "p", i, "r0", r.randint(1, 100, p), r.randint(1, 100, n), logp, logp,
                                    np.full(n, version - r.randint(0, 2)), version, float(r.rand()), "stop"))
        out.append(group)
    return out


def _cfg(**learner):
    lc = dict(global_batch_groups=2, max_seq_len=48, min_bucket=8, precompile=False, logprob_chunk=16)
    lc.update(learner)
    c = Config(run=RunConfig(steps=10), learner=LearnerConfig(**lc))
    return dataclasses.replace(c, data=dataclasses.replace(c.data, group_size=GROUP))


def _layouts(cfg, fns, groups):
    batch = B.assemble(groups, learner_version=4, max_seq_len=cfg.learner.max_seq_len, min_len=cfg.learner.min_bucket,
                       rows=len(groups) * GROUP)
    batch["advantages"], _ = fns.advantages(batch, len(groups))
    return B.layout(batch, 1, pack_rows=cfg.learner.pack, max_seq_len=cfg.learner.max_seq_len,
                    row_multiple=fns.row_multiple)[0]


def test_pack_first_fit_decreasing_and_rejection():
    bins = B.first_fit_decreasing([5, 9, 3, 7, 4], 12)
    assert sorted(sum(([5, 9, 3, 7, 4][i] for i in b), 0) <= 12 for b in bins) and len(bins) == 3
    groups = _groups([(3, 10), (2, 47), (4, 5), (1, 2)])
    kept, rejected = B.reject_too_long(groups, 48)
    assert rejected == 1 and sum(len(g) for g in kept) == 3
    packed = B.pack(B.assemble(kept, learner_version=4, max_seq_len=48, rows=4), max_seq_len=48, row_multiple=2)
    assert packed["tokens"].shape == (2, 48)  # 13 + 9 + 3 tokens in one row, rows a multiple of 2
    assert packed["segment_ids"][0].max() == 3 and packed["segment_ids"][1].max() == 0
    assert B.row_buckets(64, 2) == (2, 4, 8, 16, 32, 64) and B.length_buckets(48, 8) == (8, 16, 32, 48)


def test_unpack_puts_every_packed_token_back_in_its_row():
    """`batch.unpack` inverts `batch.pack` on every token of every valid row (the learner reads
    the packed train step's per-token log-probs back in the batch's rows); padding reads 0."""
    groups = _groups([(3, 10), (2, 20), (4, 5), (1, 2), (5, 7), (2, 9), (3, 3), (6, 12)])
    batch = B.assemble(groups, learner_version=4, max_seq_len=48, min_len=8, rows=12)   # 4 padding rows
    packed = B.pack(batch, max_seq_len=48, row_multiple=2)
    assert packed["tokens"].shape[0] < 8
    real = batch["segment_ids"] > 0
    for key in ("tokens", "positions", "behaviour_logp", "response_mask"):
        back = B.unpack(packed[key], batch, max_seq_len=48)
        np.testing.assert_array_equal(back[real], batch[key][real], err_msg=key)
        assert not back[~real].any(), key
    places = B.pack_places(batch, max_seq_len=48)
    assert sorted(i for i, *_ in places) == list(range(8)), "every valid row placed once"


def test_packed_logprobs_losses_and_grads_equal_unpacked():
    """Every aggregation mode (each with its global normaliser) and the prox log-probs."""
    lengths = [(3, 12), (5, 2), (2, 30), (4, 9), (6, 1), (3, 20), (2, 7), (4, 15)]
    groups = _groups(lengths)
    results = {}
    for pack in (False, True):
        cfg = _cfg(pack=pack)
        setup = build_setup(cfg, total_steps=10)
        fns = {}
        for mode in AGGREGATIONS:
            agg = AggregationSpec(mode=mode, norm_constant=32.0 if mode.endswith("norm") else 0.0)
            cm = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, aggregation=agg))
            fns[mode] = (cm, rl_step.build(cm, setup, mini_batch_rows=len(lengths)))
        mb = _layouts(cfg, fns["token-mean"][1], groups)
        prox = fns["token-mean"][1].logprobs(setup.state.params, mb)
        inputs = {m: rl_step.train_inputs(cm, mb) for m, (cm, _) in fns.items()}

        @jax.jit
        def all_modes(params, inputs):
            return {m: jax.value_and_grad(f.loss, has_aux=True)(params, inputs[m]) for m, (_, f) in fns.items()}
        out = all_modes(setup.state.params, inputs)
        # per-trajectory views, to compare layouts: (sum of logp, number of tokens) by response
        seg = mb["segment_ids"]
        key = lambda r, s: tuple(mb["tokens"][r][seg[r] == s])  # noqa: E731
        per_traj = {key(r, s): float(prox[r][seg[r] == s].sum()) for r in range(seg.shape[0])
                    for s in range(1, seg[r].max() + 1)}
        results[pack] = (out, per_traj, mb["tokens"].shape)
    (unpacked, traj_u, shape_u), (packed, traj_p, shape_p) = results[False], results[True]
    assert shape_p[0] < shape_u[0]  # fewer rows: 8 trajectories fit in 4 rows of 48
    assert traj_u.keys() == traj_p.keys()
    for k in traj_u:
        np.testing.assert_allclose(traj_p[k], traj_u[k], rtol=1e-5, atol=1e-5)
    for mode in AGGREGATIONS:
        (lu, _), gu = unpacked[mode]
        (lp_, _), gp = packed[mode]
        np.testing.assert_allclose(lp_, lu, rtol=1e-5, atol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), gp, gu)
    assert abs(float(unpacked["token-mean"][0][0]) - float(unpacked["seq-mean-token-sum"][0][0])) > 1e-6


@pytest.mark.parametrize("pack", [False, True])
def test_no_compile_after_a_buckets_first_step(pack):
    """Compile counter over the learner update across batches: each bucket compiles on its
    first step only; with precompile, the train step never compiles during the steps."""
    cfg = _cfg(pack=pack, micro_batch_size=2, max_seq_len=32, min_bucket=16)
    setup = build_setup(cfg, total_steps=10)
    fns = rl_step.build(cfg, setup, mini_batch_rows=2 * GROUP)
    compiles = []
    listener = lambda event, duration, **kw: compiles.append(kw.get("fun_name", "")) \
        if event == "/jax/core/compile/backend_compile_duration" else None  # noqa: E731
    monitoring.register_event_duration_secs_listener(listener)
    try:
        state, seen = setup.state, set()
        shapes = set(rl_step.batch_shapes(cfg, fns))
        # short, long, short again, long again: unpacked, row lengths from the buckets 16, 32;
        # packed, 8 rows x 32 of the first, then 2 or 4 rows
        for step, top in enumerate([30, 8, 28, 6, 31]):
            lengths = [(2, 1 + (top - 3) * i // 7) for i in range(8)]
            mb = _layouts(cfg, fns, _groups(lengths, seed=step))
            shape = mb["tokens"].shape
            assert shape in shapes  # known up front
            before = len(compiles)
            inputs = rl_step.train_inputs(cfg, mb)
            state, _ = fns.train(state, jax.device_put(inputs))
            if shape in seen:
                assert compiles[before:] == [], (step, shape, compiles[before:])
            seen.add(shape)
        if pack:
            return
        # ahead of time: every shape compiled before a step, then no step compiles
        fns2 = rl_step.build(cfg, setup, mini_batch_rows=2 * GROUP)
        rl_step.precompile_all(cfg, fns2, state, num_groups=2)
        before = len(compiles)
        for step, top in enumerate([30, 6, 20]):
            mb = _layouts(cfg, fns2, _groups([(2, 1 + (top - 3) * i // 7) for i in range(8)], seed=step))
            state, _ = fns2.train(state, jax.device_put(rl_step.train_inputs(cfg, mb)))
            fns2.logprobs(state.params, mb)   # the whole batch's pass (one mini-batch here)
        assert not [c for c in compiles[before:] if "step_fn" in c], compiles[before:]
        # the learner's log-prob pass of each bucket was compiled ahead of time too
        assert fns2.logprobs.aot.call_compiles == 0 and fns2.train.call_compiles == 0
    finally:
        monitoring.unregister_event_duration_listener(listener)
