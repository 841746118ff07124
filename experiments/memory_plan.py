"""Per-device memory of the paper presets' learner step, on paper: lower and compile one train
step on fake CPU devices (fsdp 8 by default, `--fsdp`) from abstract inputs
(`jax.ShapeDtypeStruct`, no weights allocated).

The step is the real one (`runtime.rl_step.build` -> `learner.train_step.TrainStep`, with the
FSDP activation/weight shardings of `ShardedModel.train_shardings`): the preset's loss,
optimizer, mesh (fsdp 8), `learner.remat`, `model.attention` (auto = blockwise on
CPU), bf16 compute over fp32 master params, log-prob chunking. The shapes: Qwen2.5-7B (and 32B)
config.json values, one row of `learner.max_seq_len` = 18,432 tokens per device per micro-batch,
two micro-batches (so the fp32 gradient accumulator is counted).

    PYTHONPATH=$PWD .venv/bin/python experiments/memory_plan.py [--models 7b,32b] [--fsdp 8,16] [--remat block]
        [--options "default;optimizer.state_dtype=bfloat16;learner.mlp_chunk=2048"] [--no-hoist] [--dump DIR]

`--options`: ';'-separated variants, each a ','-separated list of config overrides (dotted keys,
as `laminar train --set`) or `default`; every model x variant is compiled in the same run.

Prints a table and writes experiments/results/memory_plan.json. XLA:CPU's buffer assignment is a
proxy for an accelerator's (same program, same shapes; fusion and bf16 handling differ: XLA:CPU
runs bf16 matmuls in fp32, so its [tokens, mlp] temporaries are fp32 -- an overestimate).

What dominates at 32B (buffer assignment, `--dump`; fsdp 8, remat block): params + Adam moments
(fp32, 46 GiB of arguments), the fp32 gradient accumulator (15.3 GiB), the saved block inputs
(bf16 [64, 18432, 5120], 11 GiB), an fp32 copy of those (22.5 GiB, XLA:CPU only, below) and a
layer's [18432, 27648] MLP temporaries (~1.9 GiB each). The gradient used to be there twice:
the accumulator (the micro-batch loop's carry) and the micro-batch's stacked [L, ...] fp32
gradients (the backward layer loop's output) being added to it. The train step now accumulates
inside the backward layer loop (`models.grad_accumulation.scan_layers_into`, used by
`runtime.rl_step` through `learner.train_step`'s `loss_accumulates`), so the second copy is gone. The fp32 copy is XLA:CPU's: it cannot dynamic-slice bf16, so it converts the
whole saved stack to fp32 and while-loop-invariant code motion hoists that convert out of the
backward layer loop; an accelerator slices bf16 natively. `--no-hoist` disables that one XLA
pass (`--xla_disable_hlo_passes=while-loop-invariant-code-motion`) to drop the CPU-only copy; the
table says which way it was compiled. The per-layer weight all-gathers stay inside the layer loop
either way (one layer's [5120, 27648] at a time; none is hoisted).
"""
from __future__ import annotations

import os
import sys

# enough fake devices for --fsdp up to 16 (the plan's mesh takes the first fsdp of them)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16"
if "--no-hoist" in sys.argv:  # before jax reads XLA_FLAGS (module docstring)
    os.environ["XLA_FLAGS"] += " --xla_disable_hlo_passes=while-loop-invariant-code-motion"
if "--dump" in sys.argv:
    os.environ["XLA_FLAGS"] += f" --xla_dump_to={sys.argv[sys.argv.index('--dump') + 1]} --xla_dump_hlo_module_re=.*step_fn.*"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from laminar_jax import sharding as shd  # noqa: E402
from laminar_jax.config_loader import load_config  # noqa: E402
from laminar_jax.learner import train_state as ts  # noqa: E402
from laminar_jax.learner.optim import optimizer_from_config  # noqa: E402
from laminar_jax.learner.setup import LearnerSetup  # noqa: E402
from laminar_jax.models.config import DecoderConfig  # noqa: E402
from laminar_jax.models.decoder import Decoder  # noqa: E402
from laminar_jax.runtime import rl_step  # noqa: E402

# config.json values of Qwen/Qwen2.5-7B and Qwen/Qwen2.5-32B (shapes only)
HF = {
    "7b": dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584, intermediate_size=18944,
               num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6,
               max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "32b": dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, rope_theta=1e6,
                max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False),
}
GIB = 2 ** 30


def _per_device_bytes(tree) -> int:
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total


def plan(cfg, model: str, *, remat: str, micro_batches: int, fsdp: int | None = None, option: str = "default"):
    m = cfg.model
    dcfg = DecoderConfig.from_hf(HF[model], param_dtype=m.param_dtype, dtype=m.dtype, attention=m.attention)
    fsdp = fsdp or cfg.mesh.fsdp
    mesh = shd.make_mesh(1, fsdp, cfg.mesh.tensor, devices=jax.devices()[:fsdp * cfg.mesh.tensor])
    init_fn = lambda: Decoder(dcfg, rngs=nnx.Rngs(0), remat=remat, mlp_chunk=cfg.learner.mlp_chunk)  # noqa: E731
    sharded = ts.shard_model(init_fn, mesh, shd.DEFAULT_RULES)
    tx, schedule = optimizer_from_config(cfg.optimizer, total_steps=cfg.run.steps)
    state = ts.abstract_train_state(sharded, tx)
    shardings = ts.train_state_shardings(tx, sharded)
    setup = LearnerSetup(dcfg, mesh, sharded, tx, schedule, state, shardings)
    div = shd.batch_divisor(mesh)
    rows, length = div * micro_batches, cfg.learner.max_seq_len
    c = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, micro_batch_size=div, remat=remat))
    fns = rl_step.build(c, setup, mini_batch_rows=rows)
    ints = ("tokens", "positions", "segment_ids")
    keys = rl_step.TRAIN_KEYS + (("prox_logp",) if fns.needs_prox else ())
    batch = {k: jax.ShapeDtypeStruct((rows, length), jnp.int32 if k in ints else jnp.float32) for k in keys}
    batch["normaliser"] = jax.ShapeDtypeStruct((), jnp.float32)
    t0 = time.perf_counter()
    compiled = fns.train.jitted(batch).lower(state, batch).compile()
    mem = compiled.memory_analysis()
    row = dict(model=model, option=option, state_dtype=cfg.optimizer.state_dtype, mlp_chunk=cfg.learner.mlp_chunk,
               logprob_chunk=cfg.learner.logprob_chunk, no_hoist="--no-hoist" in sys.argv,
               params_b=dcfg.num_params() / 1e9, devices=mesh.size, mesh=dict(mesh.shape),
               tokens_per_device_micro_batch=length, micro_batches=micro_batches, remat=remat,
               attention=m.attention, dtype=m.dtype, param_dtype=m.param_dtype,
               params_bytes=_per_device_bytes(state.params), opt_state_bytes=_per_device_bytes(state.opt_state),
               argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
               alias_bytes=int(mem.alias_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
               compile_s=time.perf_counter() - t0)
    row["peak_bytes"] = row["argument_bytes"] + row["output_bytes"] - row["alias_bytes"] + row["temp_bytes"]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/paper/qwen7b_math_laminar.yaml")
    ap.add_argument("--models", default="7b,32b")
    ap.add_argument("--remat", default=None, help="override learner.remat (default: the preset's)")
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--fsdp", default=None, help="comma list per model overriding mesh.fsdp, e.g. 8,16")
    ap.add_argument("--options", default="default",
                    help="';'-separated variants, each ','-separated config overrides or 'default'")
    ap.add_argument("--no-hoist", action="store_true",
                    help="disable XLA:CPU's while-loop-invariant code motion (drops a CPU-only fp32 copy)")
    ap.add_argument("--dump", default=None, help="XLA dump folder (buffer assignment) for the step")
    ap.add_argument("--out", default="experiments/results/memory_plan.json")
    args = ap.parse_args()
    variants = [v.strip() for v in args.options.split(";") if v.strip()]
    rows = []
    models = args.models.split(",")
    fsdps = [int(f) for f in args.fsdp.split(",")] if args.fsdp else [None] * len(models)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    for model, fsdp in zip(models, fsdps, strict=True):
        for option in variants:
            overrides = [] if option == "default" else [o.strip() for o in option.split(",")]
            cfg = load_config(args.config, overrides)
            remat = args.remat or cfg.learner.remat
            r = plan(cfg, model, remat=remat, micro_batches=args.micro_batches, fsdp=fsdp, option=option)
            rows.append(r)
            print(f"{model} fsdp {r['mesh']['fsdp']} [{option}]: peak {r['peak_bytes'] / GIB:.1f} GiB, "
                  f"compiled in {r['compile_s']:.0f} s", flush=True)
            with open(args.out, "w") as f:  # partial results survive a run cut short
                json.dump(dict(config=args.config, rows=rows, argv=sys.argv[1:]), f, indent=1)
    print(f"\n{args.config}: per device, {cfg.learner.max_seq_len} tokens per device per micro-batch, "
          f"{args.micro_batches} micro-batches, remat={remat}, attention={cfg.model.attention} (CPU: blockwise), "
          f"{'--no-hoist (CPU-only fp32 copy of the saved stack dropped)' if args.no_hoist else 'XLA:CPU as is'}")
    print("| model | fsdp | option | params | optimizer state | activations + temp | peak (args + out - donated + temp) "
          "| vs default | fits 80 GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["mesh"] == r["mesh"]
                     and b["option"] == "default"), None)
        delta = "" if base is None or base is r else f"{(r['peak_bytes'] - base['peak_bytes']) / GIB:+.1f} GiB"
        print(f"| Qwen2.5-{r['model'].upper()} ({r['params_b']:.1f}B) | {r['mesh']['fsdp']} | {r['option']} | "
              f"{r['params_bytes'] / GIB:.1f} GiB | {r['opt_state_bytes'] / GIB:.1f} GiB | {r['temp_bytes'] / GIB:.1f} GiB | "
              f"{r['peak_bytes'] / GIB:.1f} GiB | {delta} | {'yes' if r['peak_bytes'] <= 80e9 else 'no'} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
