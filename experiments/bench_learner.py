"""Learner train-step benchmark: tokens/s, MFU and peak memory, tiny (2-layer) vs ~100M params.

    .venv/bin/python experiments/bench_learner.py [--models tiny,100m] [--steps 3] [--devices 1]
    python experiments/bench_learner.py --models qwen0.5b --dtype bfloat16 --shape qwen0.5b=8x2048  # a GPU

Models: the presets, and "qwen0.5b" (Qwen2.5-0.5B's shape, random init). MFU (model FLOPs
utilisation) = tokens/s x (6 N + 12 L H D T) / the devices' peak, the PaLM paper's count (N
parameters, L layers, H heads of D, T tokens per row; fwd + bwd, attention counted in full), with
the peak dense bf16 FLOP/s of the device kind (H100/H200 989e12, A100 312e12) or --peak-tflops;
none on CPU.

For each model: one sharded AdamW step (next-token cross-entropy through the chunked log-prob
path, as the RL loss uses it) on random packed tokens, timed after a warm-up call. Memory is
XLA's compiled estimate (arguments + outputs + temporaries, per device) and the process's peak
RSS; the chunked log-prob pass is also compiled against the full-logits version to show the
memory the chunking saves on the log-prob head. Results are printed and written to
experiments/results/bench_learner.json. Numbers vary with the machine and its load: compare the
ratios inside one run, not absolute numbers across runs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,100m", help="comma-separated presets")
    p.add_argument("--steps", type=int, default=3, help="timed steps per model")
    p.add_argument("--devices", type=int, default=1,
                   help="fake CPU devices (sets XLA_FLAGS; mesh data=-1 uses all of them)")
    p.add_argument("--dtype", default="float32", help="compute dtype (params stay float32)")
    p.add_argument("--attention", default="auto", help="model.attention (auto: cudnn on GPU, else blockwise)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense TFLOP/s of one device for the MFU (default: by device kind)")
    p.add_argument("--shape", action="append", default=[],
                   help="per-model batch override, e.g. 100m=4x256 (rows x tokens)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "bench_learner.json"))
    return p.parse_args()


DEFAULT_SHAPES = {"tiny": (16, 256), "100m": (4, 256), "qwen0.5b": (8, 2048)}
# Qwen2.5-0.5B's config.json shape (weights random)
QWEN_05B = dict(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896, intermediate_size=4864,
                num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6,
                max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6)
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def model_config(name: str, dtype: str, attention: str):
    from laminar_jax.models.config import DecoderConfig
    if name == "qwen0.5b":
        return DecoderConfig.from_hf(QWEN_05B, source="Qwen2.5-0.5B shape", dtype=dtype, attention=attention)
    return DecoderConfig.preset(name, dtype=dtype, attention=attention)


def flops_per_token(cfg, n_params: float, row_tokens: int) -> float:
    """6 N + 12 L H D T: fwd + bwd FLOPs per token (PaLM, appendix B)."""
    return 6 * n_params + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * row_tokens


def peak_flops(device_kind: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_kind), None)


def _chunked_head(chunk):
    from laminar_jax.learner.logprobs import chunked_token_logprobs

    def f(h, w, y):
        return chunked_token_logprobs(h, w, y, chunk_size=chunk)[0].sum()
    return f


def _naive_head(h, w, y):
    import jax
    import jax.numpy as jnp
    logsm = jax.nn.log_softmax(jnp.einsum("bth,hv->btv", h, w), axis=-1)
    return jnp.take_along_axis(logsm, y[..., None], axis=-1).sum()


def _head_temp_mib(f, shapes) -> float:
    """XLA's temporary memory for d f / d (hidden, lm_head), compiled only (nothing runs)."""
    import jax
    grad = jax.jit(jax.grad(f, argnums=(0, 1)))
    return grad.lower(*shapes).compile().memory_analysis().temp_size_in_bytes / 2**20


def main() -> int:
    args = _parse()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.devices > 1:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from laminar_jax import sharding as shd
    from laminar_jax.learner import logprobs as lp
    from laminar_jax.learner import train_state as ts
    from laminar_jax.learner.optim import make_optimizer
    from laminar_jax.learner.train_step import TrainStep
    from laminar_jax.models.decoder import Decoder

    shapes = dict(DEFAULT_SHAPES)
    for s in args.shape:
        name, dims = s.split("=")
        shapes[name] = tuple(int(x) for x in dims.split("x"))
    mesh = shd.make_mesh(-1, 1, 1)
    results = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "jax": jax.__version__, "devices": len(jax.devices()),
                           "device_kind": jax.devices()[0].device_kind},
               "models": {}}
    print(f"bench_learner: {len(jax.devices())} {jax.devices()[0].platform} device(s), "
          f"mesh {dict(mesh.shape)}", flush=True)

    for name in args.models.split(","):
        cfg = model_config(name, args.dtype, args.attention)
        rows, length = shapes[name]
        init_fn = lambda cfg=cfg: Decoder(cfg, rngs=nnx.Rngs(0))  # noqa: E731
        sm = ts.shard_model(init_fn, mesh)
        params = ts.init_params(sm, init_fn)
        tx, sched = make_optimizer(lr=1e-4, weight_decay=0.01)
        state, shardings = ts.init_train_state(sm, params, tx)
        chunk = 128

        def loss_fn(params, batch, sm=sm):
            logp, _ = lp.sequence_logprobs(sm.bind(params), batch["tokens"], batch["positions"],
                                           batch["segment_ids"], chunk_size=chunk)
            return -jnp.sum(logp) / batch["num_tokens"], {}

        rng = np.random.default_rng(0)
        # two packed sequences per row
        half = length // 2
        batch = {"tokens": rng.integers(0, cfg.vocab_size, (rows, length)).astype(np.int32),
                 "positions": np.tile(np.r_[np.arange(half), np.arange(length - half)],
                                      (rows, 1)).astype(np.int32),
                 "segment_ids": np.tile(np.r_[np.ones(half), 2 * np.ones(length - half)],
                                        (rows, 1)).astype(np.int32),
                 "num_tokens": np.float32(rows * (length - 2))}
        step = TrainStep(loss_fn, tx, shardings, schedule=sched)
        device_batch = shd.shard_batch(batch, mesh)
        t0 = time.perf_counter()
        compiled = step.jitted(device_batch).lower(state, device_batch).compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        t0 = time.perf_counter()
        state, m = step(state, device_batch)                     # warm-up (includes compile)
        first_s = time.perf_counter() - t0
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, m = step(state, device_batch)
            times.append(time.perf_counter() - t0)
        step_s = float(np.median(times))
        tokens = rows * length

        # what chunking saves: grad of the log-prob head alone (hidden -> per-token log-probs),
        # chunked vs full [B, T, V] fp32 logits, at the bench shape and at a long-sequence shape
        head = {}
        for hb, ht in ((rows, length), (16, 4096)):
            shapes_ = (jax.ShapeDtypeStruct((hb, ht, cfg.hidden_size), jnp.float32),
                       jax.ShapeDtypeStruct((cfg.hidden_size, cfg.vocab_size), jnp.float32),
                       jax.ShapeDtypeStruct((hb, ht), jnp.int32))
            head[f"{hb}x{ht}"] = {k: _head_temp_mib(f, shapes_) for k, f in
                                  (("chunked", _chunked_head(chunk)), ("full_logits", _naive_head))}
        peak_fl = peak_flops(jax.devices()[0].device_kind, args.peak_tflops)
        mfu = (tokens / step_s * flops_per_token(cfg, sm.num_params(), length) / (peak_fl * len(jax.devices()))
               if peak_fl else None)
        r = {"params_m": sm.num_params() / 1e6, "batch": [rows, length], "tokens_per_step": tokens,
             "dtype": args.dtype, "attention": cfg.attention, "mfu": mfu, "peak_flops_per_device": peak_fl,
             "compile_s": compile_s, "first_call_s": first_s, "step_s_median": step_s, "step_s": times,
             "tokens_per_s": tokens / step_s, "final_loss": m["loss"],
             "compiled_bytes_per_device": {"arguments": mem.argument_size_in_bytes,
                                           "outputs": mem.output_size_in_bytes,
                                           "temporaries": mem.temp_size_in_bytes},
             "peak_rss_mib_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
             "logprob_head_grad_temp_mib": head}
        results["models"][name] = r
        peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)
        print(f"{name:>5}: {r['params_m']:7.1f}M params  batch {rows}x{length}  "
              f"step {step_s * 1e3:8.1f} ms  {r['tokens_per_s']:9,.0f} tokens/s  "
              f"peak (XLA) {peak / 2**20:8.1f} MiB/device  peak RSS {r['peak_rss_mib_so_far']:7.0f} MiB"
              + ("" if mfu is None else f"  MFU {mfu:.1%}"),
              flush=True)
        for shape, h in head.items():
            print(f"       log-prob head grad at {shape}: chunked {h['chunked']:8.1f} MiB vs full "
                  f"logits {h['full_logits']:8.1f} MiB ({h['full_logits'] / h['chunked']:.1f}x)",
                  flush=True)
        del state, params, step, compiled

    names = list(results["models"])
    if len(names) >= 2:
        a, b = results["models"][names[0]], results["models"][names[-1]]
        results["ratios"] = {
            f"tokens_per_s_{names[0]}_over_{names[-1]}": a["tokens_per_s"] / b["tokens_per_s"],
            f"params_{names[-1]}_over_{names[0]}": b["params_m"] / a["params_m"]}
        print("ratios:", json.dumps(results["ratios"]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
