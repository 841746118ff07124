"""How far the JAX engine's behaviour log-probs are from the learner's recompute of the same tokens.

    python experiments/mismatch_engine_vs_learner.py [--dtypes float32,bfloat16] [--requests 16]
        [--concurrency 8] [--new-tokens 48] [--preset tiny] [--modes default,zero_mismatch]

For each compute dtype: a randomly initialised decoder (`--preset`, params in that dtype, as the
rollout copy is), the JAX engine (`rollout.jax_engine`, paged KV cache, continuous batching)
samples `--requests` responses (temperature 1, prompts of 4-24 random tokens, `--concurrency`
sequences at once), and the learner's code (`learner.logprobs.sequence_logprobs`, the chunked
training forward) recomputes the log-probs of those tokens with the same weights and dtype, once
with all trajectories in one padded batch and once one trajectory per call. The engine reports
`raw_logp` (temperature 1, untruncated: what the learner computes). Metrics per token over the
response tokens: `rl.mismatch.mismatch_metrics` (abs mean / max, k1, k3, chi2) and the fraction of
tokens whose two log-probs are bit-identical; plus the learner against itself (batched vs one per
call), which shows how much comes from batch-dependent reductions alone. Mode "default" is the
ordinary decoder (the baseline); "zero_mismatch" is `rollout.zero_mismatch: true`
(`model.attention: exact` on both sides, `models.exact`), which must give exactly 0.

Cost: each mode's engine runs the same requests twice, the first run compiling; the second is
timed: `decode_tok_s` = response tokens / wall seconds of the whole generation (prefill
included), and `learner_logp_s` the second call of the learner's jitted batched recompute.
Prints a table; writes experiments/results/mismatch_engine_vs_learner.json.
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


def _learner_fn(model):
    """Jitted (state, tokens, positions, segment_ids, response_mask) -> the learner's log-probs."""
    import jax
    from flax import nnx

    from laminar_jax.learner import logprobs as lp
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, *a: lp.sequence_logprobs(nnx.merge(graphdef, st), *a[:3], response_mask=a[3],
                                                     chunk_size=128)[0])
    return fn, state


def _learner_logp(learner, trajs, pad_to, timings=None):
    import time

    import jax
    import jax.numpy as jnp
    b = len(trajs)
    tokens = np.zeros((b, pad_to), np.int32)
    seg = np.zeros((b, pad_to), np.int32)
    pos = np.zeros((b, pad_to), np.int32)
    resp = np.zeros((b, pad_to), np.float32)
    for i, (prompt, response) in enumerate(trajs):
        n, p = len(prompt) + len(response), len(prompt)
        tokens[i, :n] = np.concatenate([prompt, response])
        seg[i, :n], pos[i, :n], resp[i, p:n] = 1, np.arange(n), 1.0
    fn, state = learner
    args = (state, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(resp))
    logp = np.asarray(fn(*args), np.float32)
    if timings is not None:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        timings["learner_logp_s"] = time.perf_counter() - start
    return [logp[i, len(pr):len(pr) + len(re)] for i, (pr, re) in enumerate(trajs)]


def run(dtype: str, mode: str, args) -> dict:
    import time

    import jax
    from flax import nnx

    from laminar_jax.models.config import DecoderConfig
    from laminar_jax.models.decoder import Decoder
    from laminar_jax.rl.mismatch import mismatch_metrics
    from rollout import engine as E
    from rollout.jax_engine import JaxEngine

    attention = "exact" if mode == "zero_mismatch" else "auto"
    cfg = DecoderConfig.preset(args.preset, param_dtype=dtype, dtype=dtype, attention=attention)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param).to_pure_dict()
    max_len = 24 + args.new_tokens
    engine = JaxEngine(cfg, jax.tree.map(np.asarray, params), max_num_seqs=args.concurrency,
                       max_model_len=max_len, page_size=16)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, rng.integers(4, 25)) for _ in range(args.requests)]

    def generate(tag):
        engine.add([E.Request(id=f"{tag}{i}", prompt_tokens=p,
                              sampling=E.SamplingParams(max_new_tokens=args.new_tokens, seed=i))
                    for i, p in enumerate(prompts)])
        out, start = [], time.perf_counter()
        while engine.has_unfinished():
            out += engine.step()
        return sorted(out, key=lambda c: int(c.request_id[1:])), time.perf_counter() - start

    done, _ = generate("a")      # compiles every shape the second run uses
    again, seconds = generate("b")
    if [c.response_tokens.tolist() for c in done] != [c.response_tokens.tolist() for c in again]:
        raise RuntimeError("the engine's second run of the same seeded requests sampled different tokens")
    trajs = [(np.asarray(c.prompt_tokens), np.asarray(c.response_tokens)) for c in done]
    engine_logp = [np.asarray(c.raw_logp, np.float32) for c in done]
    timings: dict = {}
    learner = _learner_fn(model)
    batched = _learner_logp(learner, trajs, max_len, timings)
    single = [_learner_logp(learner, [t], max_len)[0] for t in trajs]

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

    tokens = int(sum(len(x) for x in engine_logp))
    return {"dtype": dtype, "mode": mode, "preset": args.preset, "tokens": tokens,
            "decode_tok_s": tokens / seconds, "learner_logp_s": timings["learner_logp_s"],
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
    ap.add_argument("--modes", default="default,zero_mismatch")
    args = ap.parse_args()
    rows = [run(d, mode, args) for d in args.dtypes.split(",") for mode in args.modes.split(",")]
    print(f"{'dtype':>9} {'mode':>13} {'pair':>26} {'abs_mean':>9} {'abs_max':>9} {'k3':>9} {'bit-equal':>9}")
    for r in rows:
        for pair in ("engine_vs_learner_batched", "engine_vs_learner_single",
                     "learner_batched_vs_single"):
            m = r[pair]
            print(f"{r['dtype']:>9} {r['mode']:>13} {pair:>26} {m['abs_mean']:>9.2e} {m['abs_max']:>9.2e} "
                  f"{m['k3']:>9.2e} {m['bit_identical_frac']:>9.3f}")
    print(f"\n{'dtype':>9} {'mode':>13} {'decode tok/s':>12} {'vs default':>10} {'learner logp s':>14}")
    for r in rows:
        base = next(b for b in rows if b["dtype"] == r["dtype"] and b["mode"] == rows[0]["mode"])
        print(f"{r['dtype']:>9} {r['mode']:>13} {r['decode_tok_s']:>12.1f} "
              f"{r['decode_tok_s'] / base['decode_tok_s']:>10.2f} {r['learner_logp_s']:>14.4f}")
    out = os.path.join(ROOT, "experiments", "results", "mismatch_engine_vs_learner.json")
    with open(out, "w") as f:
        json.dump({"rows": rows, "args": vars(args), "machine": platform.platform()}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
