"""How far the JAX engine's behaviour log-probs are from the learner's recompute of the same tokens.

    python experiments/mismatch_engine_vs_learner.py [--dtypes float32,bfloat16] [--requests 16]
        [--concurrency 8] [--new-tokens 48] [--preset tiny]

For each compute dtype: a randomly initialised decoder (`--preset`, params in that dtype, as the
rollout copy is), the JAX engine (`rollout.jax_engine`, paged KV cache, continuous batching)
samples `--requests` responses (temperature 1, prompts of 4-24 random tokens, `--concurrency`
sequences at once), and the learner's code (`learner.logprobs.sequence_logprobs`, the chunked
training forward) recomputes the log-probs of those tokens with the same weights and dtype, once
with all trajectories in one padded batch and once one trajectory per call. The engine reports
`raw_logp` (temperature 1, untruncated: what the learner computes). Metrics per token over the
response tokens: `rl.mismatch.mismatch_metrics` (abs mean / max, k1, k3, chi2) and the fraction of
tokens whose two log-probs are bit-identical; plus the learner against itself (batched vs one per
call), which shows how much comes from batch-dependent reductions alone. This is the baseline a
zero-mismatch mode must bring to exactly 0. Prints a table; writes
experiments/results/mismatch_engine_vs_learner.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _learner_logp(model, trajs, pad_to):
    import jax.numpy as jnp

    from laminar_jax.learner import logprobs as lp
    b = len(trajs)
    tokens = np.zeros((b, pad_to), np.int32)
    seg = np.zeros((b, pad_to), np.int32)
    pos = np.zeros((b, pad_to), np.int32)
    resp = np.zeros((b, pad_to), np.float32)
    for i, (prompt, response) in enumerate(trajs):
        n, p = len(prompt) + len(response), len(prompt)
        tokens[i, :n] = np.concatenate([prompt, response])
        seg[i, :n], pos[i, :n], resp[i, p:n] = 1, np.arange(n), 1.0
    logp, _ = lp.sequence_logprobs(model, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg),
                                   response_mask=jnp.asarray(resp), chunk_size=128)
    logp = np.asarray(logp, np.float32)
    return [logp[i, len(pr):len(pr) + len(re)] for i, (pr, re) in enumerate(trajs)]


def run(dtype: str, args) -> dict:
    import jax
    from flax import nnx

    from laminar_jax.models.config import DecoderConfig
    from laminar_jax.models.decoder import Decoder
    from laminar_jax.rl.mismatch import mismatch_metrics
    from rollout import engine as E
    from rollout.jax_engine import JaxEngine

    cfg = DecoderConfig.preset(args.preset, param_dtype=dtype, dtype=dtype)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param).to_pure_dict()
    max_len = 24 + args.new_tokens
    engine = JaxEngine(cfg, jax.tree.map(np.asarray, params), max_num_seqs=args.concurrency,
                       max_model_len=max_len, page_size=16)
    rng = np.random.default_rng(1)
    reqs = [E.Request(id=str(i), prompt_tokens=rng.integers(0, cfg.vocab_size, rng.integers(4, 25)),
                      sampling=E.SamplingParams(max_new_tokens=args.new_tokens, seed=i))
            for i in range(args.requests)]
    engine.add(reqs)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    done.sort(key=lambda c: int(c.request_id))
    trajs = [(np.asarray(c.prompt_tokens), np.asarray(c.response_tokens)) for c in done]
    engine_logp = [np.asarray(c.raw_logp, np.float32) for c in done]
    batched = _learner_logp(model, trajs, max_len)
    single = [_learner_logp(model, [t], max_len)[0] for t in trajs]

    def table(a, b):
        n = max(len(x) for x in a)
        A = np.zeros((len(a), n), np.float32)
        Bm = np.zeros_like(A)
        M = np.zeros_like(A)
        for i, (x, y) in enumerate(zip(a, b)):
            A[i, :len(x)], Bm[i, :len(y)], M[i, :len(x)] = x, y, 1.0
        out = {k: float(v) for k, v in mismatch_metrics(A, Bm, M).items()}
        out["bit_identical_frac"] = float(((A == Bm) & (M > 0)).sum() / M.sum())
        return out

    return {"dtype": dtype, "preset": args.preset, "tokens": int(sum(len(x) for x in engine_logp)),
            "engine_vs_learner_batched": table(batched, engine_logp),
            "engine_vs_learner_single": table(single, engine_logp),
            "learner_batched_vs_single": table(batched, single)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args()
    rows = [run(d, args) for d in args.dtypes.split(",")]
    print(f"{'dtype':>9} {'pair':>28} {'abs_mean':>9} {'abs_max':>9} {'k3':>9} {'bit-equal':>9}")
    for r in rows:
        for pair in ("engine_vs_learner_batched", "engine_vs_learner_single",
                     "learner_batched_vs_single"):
            m = r[pair]
            print(f"{r['dtype']:>9} {pair:>28} {m['abs_mean']:>9.2e} {m['abs_max']:>9.2e} "
                  f"{m['k3']:>9.2e} {m['bit_identical_frac']:>9.3f}")
    out = os.path.join(ROOT, "experiments", "results", "mismatch_engine_vs_learner.json")
    with open(out, "w") as f:
        json.dump({"rows": rows, "args": vars(args), "machine": platform.platform()}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
