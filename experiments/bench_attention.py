"""Attention memory/time and packing throughput of the learner.

Part 1, attention: for the tiny and ~100M presets and T = 1K .. 16K (one sequence), the compiled
peak temp memory (`lowered.compile().memory_analysis().temp_size_in_bytes`) of forward+backward of
the mean next-token log-prob (`learner.logprobs.sequence_logprobs`), and its step time, with
`model.attention` blockwise and naive in the same run. Timing is skipped where a step would take
too long on this machine (--time-max-tokens) or naive's temp memory exceeds --naive-time-max-gb.

Part 2, packing: useful (non-pad) learner tokens/s of the real RL train step (`runtime.rl_step`)
on a long-tail length distribution (log-normal, p99/p50 ~ 10), `learner.pack` true vs false,
same run, same batches.

    PYTHONPATH=$PWD .venv/bin/python experiments/bench_attention.py [--quick]

Prints tables and writes experiments/results/bench_attention.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from laminar_jax.learner.logprobs import sequence_logprobs  # noqa: E402
from laminar_jax.models.config import DecoderConfig  # noqa: E402
from laminar_jax.models.decoder import Decoder  # noqa: E402


def _grad_fn(cfg: DecoderConfig):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)

    def loss(p, tokens, positions):
        logp, _ = sequence_logprobs(nnx.merge(graphdef, p), tokens, positions, chunk_size=1024)
        return jnp.mean(logp)
    return jax.jit(jax.value_and_grad(loss)), params


def attention_rows(presets, lengths, impls, *, time_max_tokens, naive_time_max_gb, dtype, on_row=None):
    rows = []
    for preset in presets:
        for impl in impls:
            cfg = DecoderConfig.preset(preset, attention=impl, dtype=dtype,
                                       max_position_embeddings=max(lengths))
            fn, abstract = _grad_fn(cfg)
            for t in lengths:
                tok = jax.ShapeDtypeStruct((1, t), jnp.int32)
                t0 = time.perf_counter()
                compiled = fn.lower(abstract, tok, tok).compile()
                mem = compiled.memory_analysis()
                row = dict(preset=preset, impl=impl, T=t, temp_bytes=int(mem.temp_size_in_bytes),
                           compile_s=time.perf_counter() - t0, step_s=None)
                too_big = impl == "naive" and row["temp_bytes"] > naive_time_max_gb * 2**30
                if t * (1 if preset == "tiny" else 8) <= time_max_tokens and not too_big:
                    params = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype), abstract)
                    tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (1, t)), jnp.int32)
                    pos = jnp.arange(t, dtype=jnp.int32)[None]
                    jax.block_until_ready(compiled(params, tokens, pos))
                    t0 = time.perf_counter()
                    jax.block_until_ready(compiled(params, tokens, pos))
                    row["step_s"] = time.perf_counter() - t0
                rows.append(row)
                if on_row is not None:  # partial results survive a run cut short
                    on_row(rows)
                step = "-" if row["step_s"] is None else f"{row['step_s']:.3f} s"
                print(f"  {preset:5s} {impl:9s} T={t:6d} temp={row['temp_bytes'] / 2**20:9.1f} MiB step={step}",
                      flush=True)
    return rows


def _long_tail(n, rng, *, median, max_len):
    # log-normal with sigma so that p99/p50 = exp(2.326 sigma) = 10
    sigma = np.log(10.0) / 2.326
    return np.clip(np.round(median * np.exp(sigma * rng.randn(n))), 4, max_len - 8).astype(int)


def packing_rows(*, steps, max_seq_len, groups, group_size, median):
    from laminar_jax.config import Config, LearnerConfig, RunConfig
    from laminar_jax.data.records import Trajectory
    from laminar_jax.learner.setup import build as build_setup
    from laminar_jax.runtime import batch as B
    from laminar_jax.runtime import rl_step

    rng = np.random.RandomState(0)
    batches, all_lengths = [], []
    for s in range(steps + 1):
        lens = _long_tail(groups * group_size, rng, median=median, max_len=max_seq_len)
        all_lengths += lens.tolist()
        gs = []
        for g in range(groups):
            grp = []
            for i in range(group_size):
                n = int(lens[g * group_size + i])
                logp = -rng.rand(n).astype(np.float32)
                grp.append(Trajectory(f"g{g}", "p", i, "r", rng.randint(1, 100, 8), rng.randint(1, 100, n),
                                      logp, logp, np.zeros(n, int), 0, float(rng.rand()), "stop"))
            gs.append(grp)
        batches.append(gs)
    out = []
    for pack in (False, True):
        base = Config(run=RunConfig(steps=100))
        cfg = dataclasses.replace(base, data=dataclasses.replace(base.data, group_size=group_size),
                                  learner=LearnerConfig(global_batch_groups=groups, max_seq_len=max_seq_len,
                                                        pack=pack, precompile=False))
        setup = build_setup(cfg, total_steps=100)
        fns = rl_step.build(cfg, setup, mini_batch_rows=groups * group_size)
        state, useful, elapsed, padded = setup.state, 0, 0.0, 0
        for s, gs in enumerate(batches):
            batch = B.assemble(gs, learner_version=0, max_seq_len=max_seq_len, min_len=64)
            batch["advantages"], _ = fns.advantages(batch, groups)
            mb = B.layout(batch, 1, pack_rows=pack, max_seq_len=max_seq_len, row_multiple=fns.row_multiple)[0]
            inputs = jax.device_put(rl_step.train_inputs(cfg, mb))
            t0 = time.perf_counter()
            state, _ = fns.train(state, inputs)
            if s:  # the first batch compiles
                elapsed += time.perf_counter() - t0
                useful += int((mb["segment_ids"] > 0).sum())
                padded += mb["tokens"].size
        out.append(dict(pack=pack, useful_tokens=useful, padded_tokens=padded, seconds=elapsed,
                        useful_tokens_per_s=useful / elapsed, fill=useful / padded))
        print(f"  pack={pack!s:5s} useful tokens/s={useful / elapsed:9.0f} fill={useful / padded:.2f}", flush=True)
    lens = np.asarray(all_lengths) + 8
    dist = dict(p50=float(np.percentile(lens, 50)), p99=float(np.percentile(lens, 99)), max=int(lens.max()))
    return out, dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny preset, T <= 4K, 3 packing steps")
    ap.add_argument("--presets", default="tiny,100m")
    ap.add_argument("--max-t", type=int, default=16384)
    ap.add_argument("--time-max-tokens", type=int, default=8192,
                    help="time a step only when T (x8 for the 100m preset) is at most this")
    ap.add_argument("--naive-time-max-gb", type=float, default=3.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--impls", default="blockwise,naive")
    ap.add_argument("--out", default="experiments/results/bench_attention.json")
    ap.add_argument("--skip-packing", action="store_true", help="attention memory/time only")
    ap.add_argument("--skip-attention", action="store_true", help="the packing part only")
    ap.add_argument("--lengths", default=None, help="comma list of T overriding 1K..max-t, e.g. 2048,4096,8192")
    args = ap.parse_args()
    presets = ["tiny"] if args.quick else args.presets.split(",")
    max_t = 4096 if args.quick else args.max_t
    lengths = [t for t in (1024, 2048, 4096, 8192, 16384) if t <= max_t]
    if args.lengths:
        lengths = [int(t) for t in args.lengths.split(",")]
    print(f"backend={jax.default_backend()} devices={jax.device_count()}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)

    def save(rows, **extra):
        with open(args.out, "w") as f:
            json.dump(dict(backend=jax.default_backend(), attention=rows, argv=sys.argv[1:], **extra), f, indent=1)
    rows = [] if args.skip_attention else attention_rows(
        presets, lengths, args.impls.split(","), time_max_tokens=args.time_max_tokens,
        naive_time_max_gb=args.naive_time_max_gb, dtype=args.dtype, on_row=lambda rows: save(rows, partial=True))
    growth = {}
    for p in ([] if args.skip_attention else presets):
        for impl in args.impls.split(","):
            mem = [r["temp_bytes"] for r in rows if r["preset"] == p and r["impl"] == impl]
            growth[f"{p}/{impl}"] = [b / a for a, b in zip(mem, mem[1:])]
    print("\n| preset | impl | " + " | ".join(f"T={t}" for t in lengths) + " | max growth/doubling |")
    print("|---" * (len(lengths) + 3) + "|")
    for key, g in growth.items():
        p, impl = key.split("/")
        cells = []
        for t in lengths:
            r = next(r for r in rows if r["preset"] == p and r["impl"] == impl and r["T"] == t)
            step = "" if r["step_s"] is None else f", {r['step_s']:.2f} s"
            cells.append(f"{r['temp_bytes'] / 2**20:.0f} MiB{step}")
        print(f"| {p} | {impl} | " + " | ".join(cells) + (f" | {max(g):.2f}x |" if g else " | - |"))
    if args.skip_packing:
        save(rows, memory_growth_per_doubling=growth)
        print(f"wrote {args.out}")
        return
    steps = 3 if args.quick else 8
    pack, dist = packing_rows(steps=steps, max_seq_len=1024, groups=8, group_size=8, median=48)
    speedup = pack[1]["useful_tokens_per_s"] / pack[0]["useful_tokens_per_s"]
    print(f"\npacking (lengths p50={dist['p50']:.0f}, p99={dist['p99']:.0f}, max={dist['max']}; "
          f"64 trajectories per step, max_seq_len 1024):")
    print("| layout | useful tokens/s | token fill |\n|---|---|---|")
    for r in pack:
        print(f"| {'packed' if r['pack'] else 'unpacked'} | {r['useful_tokens_per_s']:.0f} | {r['fill']:.2f} |")
    print(f"packed / unpacked useful tokens/s: {speedup:.2f}x")
    save(rows, memory_growth_per_doubling=growth, packing=pack, packing_lengths=dist, packing_speedup=speedup)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
