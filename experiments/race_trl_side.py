"""TRL's side of experiments/race_trl.py: GRPO with `trl.GRPOTrainer` on a built-in task.

Runs inside the TRL venv (torch CPU, trl, transformers; no jax): `race_trl.py` starts it as
    <venv>/bin/python experiments/race_trl_side.py SETTINGS.json
and reads the JSON lines it appends to settings["log"]: one per optimizer step with the wall
clock, the batch's mean reward and the step's seconds. Prompts and rewards are laminar_jax's own
(`laminar_jax.data.tasks`, pure python + numpy), so both sides train on the same rows and score
with the same function.
"""
from __future__ import annotations

import json
import os
import sys
import time

T_LAUNCH = time.time()


def main(path: str) -> None:
    with open(path) as f:
        s = json.load(f)
    sys.path.insert(0, s["repo"])
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from laminar_jax.data.tasks import get_task, task_score

    # torch's intra-op threads: more threads than free cores spin against each other (35-47 s
    # per step with 2 threads on the loaded 2-core machine, 1.4-1.8 s with 1)
    torch.set_num_threads(s["threads"])
    torch.manual_seed(s["seed"])
    rows = get_task(s["task"], num_prompts=s["num_prompts"], seed=s["data_seed"]).rows()
    ds = Dataset.from_list([{"prompt": r.prompt, "row": json.dumps(dict(r.row))} for r in rows])
    tok = AutoTokenizer.from_pretrained(s["model"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    # the same stop token as laminar's engine: the tokenizer's eos
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id

    def reward(prompts, completions, row, **_):
        return [task_score(c, json.loads(r)) for c, r in zip(completions, row)]

    log = open(s["log"], "a")

    class Log(TrainerCallback):
        def __init__(self):
            self.last = time.time()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                now = time.time()
                log.write(json.dumps({"step": state.global_step, "t": now - T_LAUNCH, "reward": logs["reward"],
                                      "step_s": now - self.last}) + "\n")
                log.flush()
                self.last = now

        def on_step_end(self, args, state, control, **kw):
            if time.time() - T_LAUNCH > s["max_s"]:   # the race's time cap, as on laminar's side
                control.should_training_stop = True

    n = s["prompts_per_step"] * s["group_size"]
    cfg = GRPOConfig(
        output_dir=s["out_dir"], use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        seed=s["seed"], max_steps=s["steps"], bf16=False,
        per_device_train_batch_size=n, generation_batch_size=n, num_generations=s["group_size"],
        num_iterations=1, gradient_accumulation_steps=1,
        max_completion_length=s["max_new_tokens"], temperature=s["temperature"], top_p=1.0, top_k=0,
        beta=0.0, epsilon=s["eps"], epsilon_high=s["eps"], loss_type="dapo", scale_rewards="group",
        mask_truncated_completions=False,
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=s["grad_clip"],
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Log()])
    log.write(json.dumps({"event": "ready", "t": time.time() - T_LAUNCH}) + "\n")
    log.flush()
    trainer.train()
    log.write(json.dumps({"event": "done", "t": time.time() - T_LAUNCH}) + "\n")
    log.close()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1])
