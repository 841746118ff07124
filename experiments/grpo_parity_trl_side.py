"""TRL's side of experiments/grpo_parity_trl.py: one GRPO batch, TRL's loss and its gradient.

Runs inside the TRL venv (torch CPU, trl, transformers; no jax):
    <venv>/bin/python experiments/grpo_parity_trl_side.py SETTINGS.json
Samples `group` completions of each given prompt (token ids from laminar's prompt encoder) with
the HF model, scores them with laminar's task reward, and computes `GRPOTrainer._compute_loss`
on that batch (advantages and the loss normaliser as `_generate_and_score_completions` makes
them), then its gradient; and, for the sampling check, settings["samples"] more completions per
prompt (their rewards and lengths). Writes an .npz: the batch (prompt / completion ids, rewards,
TRL's advantages), every parameter's gradient under its HF name, and the samples' rewards and
lengths.
"""
from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    with open(path) as f:
        s = json.load(f)
    sys.path.insert(0, s["repo"])
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from laminar_jax.data.tasks import task_score

    torch.manual_seed(s["seed"])
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(s["model"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    g, eos, pad = s["group"], tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts, completions, rewards = [], [], []
    with torch.no_grad():
        for ids, row in zip(s["prompt_ids"], s["rows"]):
            out = model.generate(torch.tensor([ids] * g), attention_mask=torch.ones(g, len(ids), dtype=torch.long),
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=s["max_new_tokens"], eos_token_id=eos, pad_token_id=pad)
            for seq in out[:, len(ids):].tolist():
                comp = seq[:seq.index(eos) + 1] if eos in seq else seq   # up to and including the stop token
                prompts.append(ids)
                completions.append(comp)
                rewards.append(task_score(tok.decode(comp, skip_special_tokens=True), row))
    # the sampling check: s["samples"] more completions per prompt (rewards and lengths only)
    sample_rewards, sample_lengths = [], []
    with torch.no_grad():
        for ids, row in zip(s["prompt_ids"], s["rows"]) if s.get("samples") else ():
            out = model.generate(torch.tensor([ids] * s["samples"]),
                                 attention_mask=torch.ones(s["samples"], len(ids), dtype=torch.long),
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=s["max_new_tokens"], eos_token_id=eos, pad_token_id=pad)
            for seq in out[:, len(ids):].tolist():
                comp = seq[:seq.index(eos) + 1] if eos in seq else seq
                sample_rewards.append(task_score(tok.decode(comp, skip_special_tokens=True), row))
                sample_lengths.append(len(comp))
    cfg = GRPOConfig(output_dir=s["out_dir"], use_cpu=True, report_to=[], per_device_train_batch_size=len(prompts),
                     generation_batch_size=len(prompts), num_generations=g, num_iterations=1,
                     gradient_accumulation_steps=1, max_completion_length=s["max_new_tokens"], temperature=1.0,
                     beta=0.0, epsilon=s["eps"], epsilon_high=s["eps"], loss_type="dapo", scale_rewards="group",
                     mask_truncated_completions=False, learning_rate=s["lr"], bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=cfg,
                          train_dataset=Dataset.from_list([{"prompt": "x"}]), processing_class=tok)
    # left-padded prompts, right-padded completions, as _generate_and_score_completions makes them
    plen, clen = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.full((len(prompts), plen), pad)
    prompt_mask = torch.zeros((len(prompts), plen), dtype=torch.long)
    completion_ids = torch.full((len(prompts), clen), pad)
    completion_mask = torch.zeros((len(prompts), clen), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        prompt_ids[i, plen - len(p):], prompt_mask[i, plen - len(p):] = torch.tensor(p), 1
        completion_ids[i, :len(c)], completion_mask[i, :len(c)] = torch.tensor(c), 1
    r = torch.tensor(rewards, dtype=torch.float32)
    mean = r.view(-1, g).mean(1).repeat_interleave(g)
    std = r.view(-1, g).std(1).repeat_interleave(g)   # unbiased, as TRL's nanstd
    advantages = (r - mean) / (std + 1e-4)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": None,
              "num_items_in_batch": completion_mask.sum()}
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {f"grad/{name}": p.grad.detach().numpy() for name, p in model.named_parameters() if p.grad is not None}
    np.savez(s["out"], loss=loss.item(), rewards=r.numpy(), advantages=advantages.numpy(),
             prompt_lens=np.array(list(map(len, prompts))), completion_lens=np.array(list(map(len, completions))),
             prompt_flat=np.concatenate(prompts), completion_flat=np.concatenate(completions),
             sample_rewards=np.asarray(sample_rewards, np.float64), sample_lengths=np.asarray(sample_lengths), **grads)


if __name__ == "__main__":
    main(sys.argv[1])
