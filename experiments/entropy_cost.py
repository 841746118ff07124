"""Cost of the entropy metric: the learner's loss + gradient pass with and without entropy.

    python experiments/entropy_cost.py [--vocab 128,8192,32768] [--batch 8] [--seq 128]
        [--chunk 64] [--repeats 7]

`loss.log_entropy: true` (the default) makes `learner.logprobs.sequence_logprobs` also return the
per-token entropy H = lse(z) - sum softmax(z) z from the same chunked logits (one more pass over
each [B, chunk, V] block, no extra logits in memory), so `loss/entropy` is measured rather than
0. This times jax.value_and_grad of the default loss on the tiny decoder (hidden 128) at several
vocabulary sizes -- the entropy's cost grows with V relative to the rest of the model -- with
both variants compiled first and timed interleaved (median of `--repeats`), so machine load hits
both alike. Prints a table and writes experiments/results/entropy_cost.json; compare the ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _time(fn, params, repeats):
    import jax
    jax.block_until_ready(fn(params))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(params))
        out.append(time.perf_counter() - t)
    return out


def run(vocab: int, batch: int, seq: int, chunk: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.learner import logprobs as lp
    from laminar_jax.models.config import DecoderConfig
    from laminar_jax.models.decoder import Decoder
    from laminar_jax.rl.compose import make_loss
    from laminar_jax.rl.spec import LossSpec

    cfg = dataclasses.replace(DecoderConfig.preset("tiny"), vocab_size=vocab)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graph, params = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    seg = jnp.ones((batch, seq), jnp.int32)
    mask = jnp.asarray(np.arange(seq)[None] >= seq // 4, jnp.float32) * jnp.ones((batch, 1))
    adv = jnp.asarray(rng.normal(size=(batch, 1)), jnp.float32) * mask
    loss = make_loss(LossSpec())

    def step(with_entropy):
        def f(p):
            m = nnx.merge(graph, p)
            logp, ent = lp.sequence_logprobs(m, tokens, pos, seg, response_mask=mask,
                                             chunk_size=chunk, with_entropy=with_entropy)
            return loss(logp, behaviour_logp=jax.lax.stop_gradient(logp),
                        prox_logp=jax.lax.stop_gradient(logp),
                        advantages=adv, mask=mask, entropy=ent)[0]
        return jax.jit(jax.value_and_grad(f))

    fns = {False: step(False), True: step(True)}
    times = {False: [], True: []}
    for _ in range(repeats):  # interleaved: load drifts hit both variants
        for k in (False, True):
            times[k] += _time(fns[k], params, 1)
    off, on = float(np.median(times[False])), float(np.median(times[True]))
    return {"vocab": vocab, "batch": batch, "seq": seq, "chunk": chunk,
            "step_s_without_entropy": off, "step_s_with_entropy": on, "ratio": on / off}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", default="128,8192,32768")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rows = [run(int(v), args.batch, args.seq, args.chunk, args.repeats)
            for v in args.vocab.split(",")]
    print(f"{'vocab':>7} {'no entropy s':>13} {'entropy s':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['vocab']:>7} {r['step_s_without_entropy']:>13.4f} "
              f"{r['step_s_with_entropy']:>10.4f} {r['ratio']:>6.3f}")
    out = os.path.join(ROOT, "experiments", "results", "entropy_cost.json")
    with open(out, "w") as f:
        json.dump({"rows": rows, "args": vars(args), "machine": platform.platform(),
                   "load_avg": os.getloadavg()}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
