"""Engine-vs-learner log-prob parity: the mismatch a rollout engine's numerics cost.

    python experiments/engine_parity.py [--engines jax,vllm] [--model tiny] [--dtypes float32,bfloat16]
        [--requests 16] [--prompt-len 16] [--new-tokens 48] [--out experiments/results/engine_parity.json]

A random-weight preset, the way a run ships it: the learner holds float32 master params and
computes in `dtype` (model.dtype), the engine gets the params cast to `dtype`
(model.rollout_dtype) as HF-named tensors. The engine samples `requests` responses (T = 1, seeded);
the learner's log-probs of the same tokens (`learner.logprobs.sequence_logprobs`, the loss's
path) are compared with the engine's `raw_logp` by `rl.mismatch.mismatch_metrics`
(abs_mean, abs_max, k1, k3, chi2 over the sampled tokens): the same numbers a run logs as
`mismatch/<engine>/*` on its fresh tokens. vLLM runs through `rollout.vllm_engine` (in process,
started from the tensors as a rollout starts it) where the vllm package is installed.
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="jax,vllm")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "engine_parity.json"))
    return p.parse_args(argv)


def _engine(kind, cfg_engine, tensors, max_len, n, workdir):
    if kind == "jax":
        from laminar_jax.models.hf import hf_to_params
        from rollout.jax_engine import JaxEngine
        return JaxEngine(cfg_engine, hf_to_params(cfg_engine, tensors), max_num_seqs=n, max_model_len=max_len,
                         page_size=16, seed=0)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from rollout.vllm_engine import VllmEngine
    return VllmEngine.from_tensors(tensors, 0, config=cfg_engine.to_hf(), workdir=workdir, max_num_seqs=n,
                                   max_model_len=max_len, dtype=cfg_engine.dtype,
                                   num_kv_blocks=max(2, n * -(-max_len // 128)) + 1)


def measure(kind: str, model: str, dtype: str, args) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.learner.logprobs import sequence_logprobs
    from laminar_jax.models.config import DecoderConfig
    from laminar_jax.models.decoder import Decoder, from_params
    from laminar_jax.models.hf import params_to_hf
    from laminar_jax.rl.mismatch import mismatch_metrics
    from rollout import engine as E

    learner_cfg = DecoderConfig.preset(model, param_dtype="float32", dtype=dtype)
    engine_cfg = DecoderConfig.preset(model, param_dtype=dtype, dtype=dtype)
    _, state = nnx.split(Decoder(learner_cfg, nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(state)
    tensors = params_to_hf(learner_cfg, params, dtype=dtype)          # what the relays ship
    max_len = args.prompt_len + args.new_tokens
    rng = np.random.default_rng(0)
    reqs = [E.Request(f"r{i}", rng.integers(0, learner_cfg.vocab_size, args.prompt_len),
                      E.SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=i))
            for i in range(args.requests)]
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as workdir:
        engine = _engine(kind, engine_cfg, tensors, max_len, args.requests, workdir)
        t0 = time.time()
        out = E.run_to_completion(engine, reqs)
        gen_s = time.time() - t0
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    learner = from_params(learner_cfg, params)
    tokens = np.zeros((len(reqs), max_len), np.int32)
    mask = np.zeros((len(reqs), max_len), np.float32)
    behaviour = np.zeros((len(reqs), max_len), np.float32)
    for row, r in enumerate(reqs):
        c = out[r.id]
        p, n = args.prompt_len, len(c.response_tokens)
        tokens[row, :p], tokens[row, p:p + n] = r.prompt_tokens, c.response_tokens
        mask[row, p:p + n], behaviour[row, p:p + n] = 1.0, c.raw_logp
    positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), tokens.shape)
    logp = jax.jit(lambda t, q: sequence_logprobs(learner, t, q)[0])(jnp.asarray(tokens), positions)
    m = mismatch_metrics(jnp.asarray(logp, jnp.float32), jnp.asarray(behaviour), jnp.asarray(mask))
    return dict(engine=kind, model=model, dtype=dtype, backend=jax.default_backend(), generate_s=gen_s,
                **{k: float(v) for k, v in m.items()})


def main(argv=None) -> list[dict]:
    args = _parse(argv)
    engines = args.engines.split(",")
    if "vllm" in engines:
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            print("vllm is not installed here: skipping the vLLM engine", file=sys.stderr)
            engines.remove("vllm")
    rows = [measure(e, args.model, d, args) for e in engines for d in args.dtypes.split(",")]
    lines = [f"{'engine':6} {'dtype':9} {'tokens':>6} | {'abs_mean':>9} {'abs_max':>9} {'k3':>9} {'chi2':>9}"]
    lines += [f"{r['engine']:6} {r['dtype']:9} {r['num_tokens']:6.0f} | {r['abs_mean']:9.2e} {r['abs_max']:9.2e} "
              f"{r['k3']:9.2e} {r['chi2']:9.2e}" for r in rows]
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(machine=dict(platform=platform.platform(), cpus=os.cpu_count()), settings=vars(args),
                       results=rows, table=lines), f, indent=2)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
