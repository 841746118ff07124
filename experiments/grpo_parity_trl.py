"""Is Laminar-JAX's GRPO update TRL's? One batch, both losses, both gradients.

    PYTHONPATH=$PWD .venv/bin/python experiments/grpo_parity_trl.py --init MODEL_DIR [--seeds 0 1 2]

experiments/race_trl.py runs both trainers with the same settings, and Laminar-JAX needs more
steps to the reward threshold than TRL on the mean. This checks the update itself, on identical
tokens: the TRL side (`grpo_parity_trl_side.py`, in the race's TRL venv) samples `group`
completions of each of `prompts` task prompts from the HF checkpoint, scores them with the task
reward, and computes `GRPOTrainer._compute_loss` (loss_type dapo, symmetric eps, no KL, group-std
advantages) and its gradient. This side builds the same trajectories, assembles them as the
learner does, sets the behaviour log-probs to the learner's own (TRL's ratio is exactly 1 at
num_iterations=1; the race's anchor is the engine's log-probs, equal up to numerics), and takes
the gradient of the learner's loss (`rl_step`'s loss_fn, the train step's). Per seed it reports
the advantages' and the loss's largest difference, the cosine of the two global gradients and
their norm ratio, and the lowest per-tensor cosine.

Sampling (--samples N per prompt, both sides): the mean reward and length of N completions per
prompt from HF `generate` (TRL's sampler) and from Laminar-JAX's JAX engine (the rollouts'), with
a two-sample standard error: the same policy must give the same reward distribution. Writes
experiments/results/grpo_parity_trl.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def laminar_grads(cfg, model_dir: str, trl: dict, group: int, work: str) -> dict:
    import jax

    from laminar_jax.data.records import Trajectory
    from laminar_jax.models.hf import params_to_hf
    from laminar_jax.runtime import batch as B, engines
    from laminar_jax.runtime.learner_actor import Learner

    learner = Learner(cfg, os.path.join(work, "run"), data=None, resume=False, store_root=os.path.join(work, "store"))
    try:
        n = len(trl["rewards"])
        p_at, c_at = np.cumsum([0, *trl["prompt_lens"]]), np.cumsum([0, *trl["completion_lens"]])
        trajs = [Trajectory(f"g{i // group}", f"p{i // group}", i % group, "r0",
                            trl["prompt_flat"][p_at[i]:p_at[i + 1]], trl["completion_flat"][c_at[i]:c_at[i + 1]],
                            np.zeros(trl["completion_lens"][i], np.float32), np.zeros(trl["completion_lens"][i], np.float32),
                            np.zeros(trl["completion_lens"][i], np.int64), 0, float(trl["rewards"][i]), "stop")
                 for i in range(n)]
        groups = [trajs[k:k + group] for k in range(0, n, group)]
        lc = cfg.learner
        batch = B.assemble(groups, learner_version=0, max_seq_len=lc.max_seq_len, min_len=lc.min_bucket, rows=n)
        batch["advantages"], _ = learner.fns.advantages(batch, len(groups))
        params = learner.state.params
        # the behaviour anchor at the learner's own log-probs: ratio 1, as TRL's on-policy step
        batch["behaviour_logp"] = np.where(batch["response_mask"] > 0, learner.fns.logprobs(params, batch), 0.0)
        mb = B.layout(batch, 1, pack_rows=False, max_seq_len=lc.max_seq_len, row_multiple=learner.fns.row_multiple)[0]
        inputs = learner.fns.inputs(params, mb)
        (loss, _), grads = jax.value_and_grad(lambda p: learner.fns.loss(p, inputs), has_aux=True)(params)
        tree = grads.to_pure_dict() if hasattr(grads, "to_pure_dict") else grads
        hf = params_to_hf(engines.model_config(cfg, model_dir), jax.tree.map(np.asarray, tree))
        # advantages per trajectory: the first response token's (every token of a row carries it)
        first = np.argmax(batch["response_mask"] > 0, axis=1)
        adv = batch["advantages"][np.arange(n), first] if batch["advantages"].ndim == 2 else batch["advantages"][:n]
        return {"loss": float(loss), "advantages": np.asarray(adv[:n], np.float64), "grads": hf}
    finally:
        learner.publisher.close()


def engine_samples(cfg, model_dir: str, rows: list, prompt_ids: list, n: int, seed: int) -> dict:
    """`n` completions per prompt from the JAX engine a rollout builds, scored by the task reward."""
    from laminar_jax.data.tasks import task_score
    from laminar_jax.models.hf import read_tensors
    from laminar_jax.runtime import engines
    from rollout.engine import Request, SamplingParams

    tokenizer = engines.tokenizer_for(model_dir)
    engine = engines.EngineFactory(cfg, model_dir, seed=seed)(read_tensors(model_dir)[0], 0)
    sp = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=cfg.rollout.max_new_tokens,
                        stop_token_ids=tuple(tokenizer.stop_token_ids))
    rewards, lengths = [], []
    for p, (ids, row) in enumerate(zip(prompt_ids, rows)):
        engine.add([Request(f"p{p}-{i}", np.asarray(ids), sp, f"p{p}") for i in range(n)])
        done = []
        while engine.has_unfinished():
            done += engine.step()
        for c in done:
            toks = [int(t) for t in c.response_tokens if int(t) not in sp.stop_token_ids]
            rewards.append(task_score(tokenizer.decode(toks), row))
            lengths.append(len(c.response_tokens))
    return {"rewards": np.asarray(rewards), "lengths": np.asarray(lengths)}


def sampling(trl: dict, ours: dict) -> dict:
    a, b = np.asarray(trl["sample_rewards"], np.float64), ours["rewards"].astype(np.float64)
    se = float(np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)))
    return {"samples_per_side": len(a), "reward_hf": float(a.mean()), "reward_engine": float(b.mean()),
            "reward_diff_in_se": float((b.mean() - a.mean()) / se), "length_hf": float(np.mean(trl["sample_lengths"])),
            "length_engine": float(ours["lengths"].mean())}


def compare(trl: dict, ours: dict) -> dict:
    names = sorted(k[len("grad/"):] for k in trl if k.startswith("grad/"))
    missing = [k for k in names if k not in ours["grads"]]
    if missing:
        raise KeyError(f"gradients without a laminar counterpart: {missing}")
    a = np.concatenate([trl[f"grad/{k}"].ravel() for k in names]).astype(np.float64)
    b = np.concatenate([np.asarray(ours["grads"][k], np.float64).ravel() for k in names])
    cos = lambda x, y: float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-30))  # noqa: E731
    per = {k: cos(trl[f"grad/{k}"].ravel().astype(np.float64), np.asarray(ours["grads"][k], np.float64).ravel())
           for k in names}
    worst = min(per, key=per.get)
    return {"loss_trl": float(trl["loss"]), "loss_laminar": ours["loss"],
            "advantages_max_abs_diff": float(np.max(np.abs(trl["advantages"] - ours["advantages"]))),
            "grad_cosine": cos(a, b), "grad_norm_trl": float(np.linalg.norm(a)),
            "grad_norm_laminar": float(np.linalg.norm(b)), "grad_norm_ratio": float(np.linalg.norm(b) / np.linalg.norm(a)),
            "worst_tensor": worst, "worst_tensor_cosine": per[worst], "tensors": len(names),
            "mean_reward": float(np.mean(trl["rewards"]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", required=True, help="the HF checkpoint both sides start from (the race's init)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--task", default="synthetic")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--eps", type=float, default=0.2)
    p.add_argument("--samples", type=int, default=64, help="completions per prompt for the sampling check (0: off)")
    p.add_argument("--venv", default=os.path.join(REPO, "experiments", ".venv-trl"))
    p.add_argument("--out", default=os.path.join(REPO, "experiments", "results", "grpo_parity_trl.json"))
    a = p.parse_args()
    from laminar_jax.config import load_config
    from laminar_jax.data.prompt_pool import PromptEncoder
    from laminar_jax.data.tasks import get_task
    from laminar_jax.runtime import engines

    cfg = load_config("configs/default.yaml", [
        f"model.hf_path={a.init}", f"data.task={a.task}", f"data.group_size={a.group}",
        f"learner.global_batch_groups={a.prompts}", "learner.precompile=false", "optimizer.weight_decay=0.0",
        f"loss.surrogate.eps_low={a.eps}", f"loss.surrogate.eps_high={a.eps}", "loss.aggregation.mode=token-mean",
        "loss.kl.coef=0.0", "loss.entropy_coef=0.0"])
    encode = PromptEncoder(engines.tokenizer_for(a.init), chat_template=cfg.data.chat_template)
    results = []
    for seed in a.seeds:
        with tempfile.TemporaryDirectory() as work:
            cfg_seed = dataclasses.replace(cfg, relay=dataclasses.replace(cfg.relay, store_dir=os.path.join(work, "stores")))
            rows = get_task(a.task, num_prompts=256, seed=seed).rows()[:a.prompts]
            settings = {"repo": REPO, "model": a.init, "seed": seed, "group": a.group, "eps": a.eps, "lr": 3e-4,
                        "max_new_tokens": a.max_new_tokens, "out_dir": os.path.join(work, "trl"),
                        "samples": a.samples,
                        "out": os.path.join(work, "trl.npz"), "rows": [dict(r.row) for r in rows],
                        "prompt_ids": [[int(t) for t in encode(r.prompt)] for r in rows]}
            with open(os.path.join(work, "settings.json"), "w") as f:
                json.dump(settings, f)
            proc = subprocess.run([os.path.join(a.venv, "bin", "python"),
                                   os.path.join(REPO, "experiments", "grpo_parity_trl_side.py"),
                                   os.path.join(work, "settings.json")], capture_output=True, text=True, timeout=900)
            if proc.returncode:
                raise RuntimeError(f"TRL side failed:\n{proc.stderr[-3000:]}")
            trl = dict(np.load(settings["out"]))
            r = compare(trl, laminar_grads(cfg_seed, a.init, trl, a.group, work))
            if a.samples:
                r.update(sampling(trl, engine_samples(cfg_seed, a.init, settings["rows"], settings["prompt_ids"],
                                                      a.samples, seed)))
            r["seed"] = seed
            results.append(r)
            print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    print("\n| seed | batch reward | loss TRL / laminar | max |adv diff| | grad cosine | norm ratio | worst tensor "
          "cosine | reward HF / engine (diff in SE) | length HF / engine |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        samp = (f"{r['reward_hf']:.3f} / {r['reward_engine']:.3f} ({r['reward_diff_in_se']:+.1f}) | "
                f"{r['length_hf']:.1f} / {r['length_engine']:.1f}") if "reward_hf" in r else "- | -"
        print(f"| {r['seed']} | {r['mean_reward']:.3f} | {r['loss_trl']:.5f} / {r['loss_laminar']:.5f} | "
              f"{r['advantages_max_abs_diff']:.2e} | {r['grad_cosine']:.5f} | {r['grad_norm_ratio']:.4f} | "
              f"{r['worst_tensor_cosine']:.4f} ({r['worst_tensor']}) | {samp} |")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"settings": vars(a), "results": results}, f, indent=1)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
