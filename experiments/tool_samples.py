"""Look at a tool policy's real multi-turn samples: the lookup task's turn loop without Ray.

Runs the supervised warm-up of a config (or takes --model), then drives the JAX engine through
`rollout.multiturn.MultiTurn` with the config's environment, exactly as a rollout worker does,
and prints a few whole trajectories (policy tokens and tool tokens marked by their loss mask)
and the rates the RL run starts from: tool-call rate, correct-call rate, reward when the tool
was called / not called, and whether the answer copied the tool result.

    PYTHONPATH=$PWD .venv/bin/python experiments/tool_samples.py configs/tool.yaml --prompts 32
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sample(cfg, model_dir: str, prompts: int, seed: int = 0) -> list[dict]:
    from laminar_jax.data.records import PromptGroup
    from laminar_jax.data.tasks import get_task
    from laminar_jax.env.registry import resolve_env
    from rollout.engine import SamplingParams
    from rollout.jax_engine import JaxEngine
    from rollout.multiturn import MultiTurn

    task = get_task(cfg.data.task, seed=seed + 7)
    tok = task.tokenizer
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=tuple(tok.stop_token_ids))
    engine = JaxEngine.from_pretrained(model_dir, max_num_seqs=r.max_concurrency, max_model_len=cfg.learner.max_seq_len)
    decode = lambda ids: tok.decode([int(x) for x in ids if int(x) not in sampling.stop_token_ids])  # noqa: E731
    turns = MultiTurn(resolve_env(cfg.env), cfg.env, tok, sampling, decode, rollout_id="probe")
    rows = task.rows()[:prompts]
    groups = {}
    for i, row in enumerate(rows):
        g = PromptGroup(group_id=f"g{i}", prompt_id=row.prompt_id, prompt=row.prompt,
                        prompt_tokens=np.asarray(tok.encode(row.prompt)), answer=row.answer, row=row.row,
                        group_size=cfg.data.group_size, epoch=0, index=i)
        groups[g.group_id] = g
        engine.add(turns.start(g, 0))
    out, deadline = [], time.time() + 600
    while len(out) < prompts * cfg.data.group_size and time.time() < deadline:
        for c in engine.step() if engine.has_unfinished() else []:
            turns.on_completion(c)
        conts, finished = turns.poll(engine.weight_version)
        for req in conts:
            engine.add([req])
        for f in finished:
            p = f.partial
            row = groups[p.group_id].row
            obs = [tok.decode([t]) for t, m in zip(p.response_tokens, p.loss_mask) if m == 0]
            text = "".join(("[" if m == 0 and (i == 0 or p.loss_mask[i - 1] == 1) else "") + tok.decode([t], False) +
                           ("]" if m == 0 and (i + 1 == len(p.loss_mask) or p.loss_mask[i + 1] == 1) else "")
                           for i, (t, m) in enumerate(zip(p.response_tokens, p.loss_mask)))
            out.append({"prompt": groups[p.group_id].prompt, "value": row["value"], "text": text,
                        "reward": f.reward, "finish": p.finish_reason, **f.stats, "tool_text": "".join(obs)})
        if not engine.has_unfinished() and turns.waiting():
            time.sleep(0.002)
    turns.close()
    return out


def summarise(samples: list[dict]) -> dict:
    called = [s for s in samples if s["tool_calls"] > 0]
    direct = [s for s in samples if s["tool_calls"] == 0]
    mean = lambda xs: float(np.mean(xs)) if xs else float("nan")  # noqa: E731
    return {"samples": len(samples), "reward": mean([s["reward"] for s in samples]),
            "tool_call_rate": mean([s["tool_calls"] > 0 for s in samples]),
            "correct_call_rate": mean([s["correct_tool_calls"] > 0 for s in samples]),
            "reward_when_called": mean([s["reward"] for s in called]),
            "reward_when_not_called": mean([s["reward"] for s in direct]),
            "tool_errors_per_traj": mean([s["tool_errors"] + s["parse_errors"] for s in samples]),
            "turns_per_traj": mean([s["turns"] for s in samples])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--model", help="a model folder (default: run the config's warm-up first)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--show", type=int, default=12)
    ap.add_argument("--json", default="experiments/results/tool_samples.json")
    args = ap.parse_args(argv)
    from laminar_jax.config import load_config
    tmp = tempfile.mkdtemp(prefix="tool_samples_")
    cfg = load_config(args.config, [f"run.out_dir={tmp}", *args.overrides])
    model_dir = args.model
    sft_summary = None
    if model_dir is None:
        from laminar_jax.learner import sft
        sft_summary = sft.run(cfg)
        model_dir = sft_summary["model_dir"]
    samples = sample(cfg, model_dir, args.prompts, seed=cfg.run.seed)
    shown = sorted(samples, key=lambda s: -s["tool_calls"])[:args.show // 2] + samples[:args.show - args.show // 2]
    for s in shown:
        print(f"{s['prompt']!r:8} value {s['value']}  reward {s['reward']:.0f}  {s['finish']:6}  {s['text']!r}")
    summary = summarise(samples)
    print("\n" + "\n".join(f"{k:24} {v:.3f}" if isinstance(v, float) else f"{k:24} {v}" for k, v in summary.items()))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"config": args.config, "overrides": args.overrides, "model": args.model,
                   "sft_last_loss": None if sft_summary is None else sft_summary["last_loss"],
                   "summary": summary, "examples": shown}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
