"""`laminar sft`: supervised warm-up on a built-in task's reference answers, sharded.

Loss: next-token cross-entropy on the response tokens (the prompt is context only),

    L = - sum_{t in responses} log p(x_t | x_<t) / (number of response tokens in the batch),

with several examples packed per row (segment ids keep them apart). Examples come from
``laminar_jax.data.tasks`` (``data.task``: countdown "13:" -> "13 12 ... 1", arithmetic "3+5=" ->
"8"; any other task name falls back to arithmetic), character-tokenised, so a tiny model learns
them within a minute on CPU. The run writes to its own folder, ``<out_dir>/<name>/sft/``
(``sft_dir``), never over a train run's files in ``<out_dir>/<name>/``; the trained model goes to
``<out_dir>/<name>/sft/sft_model`` (a Hugging Face folder, with the tokenizer for presets), which
is where ``laminar train`` with the same name looks for its warm-up model, and which
``model.hf_path`` can start any RL run from.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any

import numpy as np

from laminar_jax.data.tasks import TASKS, get_task
from laminar_jax.models.config import DecoderConfig

FALLBACK_TASK = "arithmetic"
POOL_SIZE = 4096


def sft_dir(cfg: Any) -> str:
    """The folder of a supervised run: `<run.out_dir>/<run.name>/sft` (beside, never over, the
    train run of the same name)."""
    return os.path.join(cfg.run.out_dir, cfg.run.name, "sft")


def pack_examples(examples: list, order: np.ndarray, start: int, batch_size: int,
                  seq_len: int) -> tuple[dict[str, np.ndarray], int]:
    """Greedy packing of ``examples[order[start:]]`` into ``[batch_size, seq_len]`` rows.

    Returns ``(batch, next_start)``; the batch has ``tokens, positions, segment_ids`` (0 =
    padding) and ``loss_mask`` (1 on response tokens, or the example's ``response_mask``: a
    multi-turn demonstration's tool results are 0), plus the scalar ``num_loss_tokens``.
    """
    out = {k: np.zeros((batch_size, seq_len), np.int32)
           for k in ("tokens", "positions", "segment_ids", "loss_mask")}
    i = start
    for row in range(batch_size):
        at, seg = 0, 1
        while True:
            ex = examples[order[i % len(order)]]
            p, r = np.asarray(ex.prompt_tokens), np.asarray(ex.response_tokens)
            n = len(p) + len(r)
            if n > seq_len:
                raise ValueError(f"sft.seq_len={seq_len} is shorter than an example of "
                                 f"{n} tokens ({ex.prompt!r} -> {ex.response!r})")
            if at + n > seq_len:
                break
            out["tokens"][row, at:at + n] = np.concatenate([p, r])
            out["positions"][row, at:at + n] = np.arange(n)
            out["segment_ids"][row, at:at + n] = seg
            out["loss_mask"][row, at + len(p):at + n] = 1 if ex.response_mask is None else ex.response_mask
            at, seg, i = at + n, seg + 1, i + 1
    batch: dict[str, Any] = dict(out)
    batch["num_loss_tokens"] = np.float32(out["loss_mask"].sum())
    return batch, i


def _examples(cfg: Any, dcfg: DecoderConfig):
    data = getattr(cfg, "data", None)
    name = getattr(data, "task", FALLBACK_TASK)
    name = name if name in TASKS else FALLBACK_TASK
    task = get_task(name, max_n=getattr(data, "task_max_n", 0), seed=cfg.run.seed)
    examples = task.sft_examples(POOL_SIZE, seed=cfg.run.seed, noise=getattr(cfg.sft, "demo_noise", 0.0))
    tokenizer = task.tokenizer
    hf_path = getattr(cfg.model, "hf_path", None)
    if hf_path and os.path.exists(os.path.join(hf_path, "tokenizer.json")):
        from laminar_jax.models.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(hf_path)
        eos = tokenizer.eos_token_id
        if any(ex.response_mask is not None for ex in examples):  # tool turns in the char format
            raise ValueError(f"sft: task {name!r} has multi-turn demonstrations written for the built-in char "
                             f"tokenizer; they cannot be re-encoded for the tokenizer of model.hf_path={hf_path}")
        examples = [dataclasses.replace(
            ex, prompt_tokens=np.asarray(tokenizer.encode(ex.prompt, add_special_tokens=False)),
            response_tokens=np.asarray(tokenizer.encode(ex.response, add_special_tokens=False)
                                       + ([eos] if eos is not None else [])))
            for ex in examples]
    top = max(int(max(e.prompt_tokens.max(initial=0), e.response_tokens.max(initial=0)))
              for e in examples)
    if top >= dcfg.vocab_size:
        raise ValueError(f"sft: task {name!r} uses token id {top}, outside the model's "
                         f"vocab_size {dcfg.vocab_size}")
    return name, examples, tokenizer


def sft_loss(sharded: Any, *, chunk_size: int):
    """``loss_fn(params, batch, grad_acc=None) -> (loss, {})``: the masked next-token NLL over
    the batch's loss tokens, ``-sum(log p) / num_loss_tokens`` (the explicit global normaliser, so
    micro-batches sum to the whole batch's mean). With ``grad_acc`` the gradient comes back as
    ``grad_acc + gradient``, summed inside the backward layer loop
    (``learner.train_step``'s ``loss_accumulates``: one fp32 gradient copy, not two)."""
    import jax.numpy as jnp

    from laminar_jax.learner import logprobs as lp
    from laminar_jax.models.grad_accumulation import decoder_params_into
    train_shardings = sharded.train_shardings()

    def loss_fn(params, batch, grad_acc=None):
        params, layer_acc = decoder_params_into(params, grad_acc)
        logp, _ = lp.sequence_logprobs(sharded.bind(params), batch["tokens"], batch["positions"],
                                       batch["segment_ids"], response_mask=batch["loss_mask"],
                                       chunk_size=chunk_size, shardings=train_shardings,
                                       layer_grad_acc=layer_acc)
        return -jnp.sum(logp) / batch["num_loss_tokens"], {}
    return loss_fn


def run(cfg: Any) -> dict[str, Any]:
    """Runs ``cfg.sft.steps`` sharded SFT steps; returns a summary dict (losses, throughput)."""
    import jax

    from laminar_jax import sharding as shd
    from laminar_jax.learner.setup import build
    from laminar_jax.learner.train_step import TrainStep

    sft = cfg.sft
    mesh = shd.mesh_from_config(cfg.mesh)
    div = shd.batch_divisor(mesh)
    micro = getattr(getattr(cfg, "learner", None), "micro_batch_size", 0) or sft.batch_size
    if sft.batch_size % micro or micro % div:
        raise ValueError(f"sft.batch_size={sft.batch_size} must be a multiple of "
                         f"learner.micro_batch_size={micro} (0 = whole batch), which must be a "
                         f"multiple of mesh data x fsdp = {div} (mesh {dict(mesh.shape)})")
    chunk = getattr(getattr(cfg, "learner", None), "logprob_chunk", 128)
    setup = build(cfg, total_steps=sft.steps, lr=sft.lr)
    dcfg, mesh, sharded, state = setup.model_cfg, setup.mesh, setup.sharded, setup.state

    step = TrainStep(sft_loss(sharded, chunk_size=chunk), setup.tx, setup.shardings,
                     schedule=setup.schedule, num_micro_batches=sft.batch_size // micro,
                     loss_accumulates=True)
    task, examples, tokenizer = _examples(cfg, dcfg)
    fits = [e for e in examples if len(e.prompt_tokens) + len(e.response_tokens) <= sft.seq_len]
    if not fits:
        raise ValueError(f"sft.seq_len={sft.seq_len}: no {task} example fits (shortest has "
                         f"{min(len(e.prompt_tokens) + len(e.response_tokens) for e in examples)} "
                         f"tokens)")
    if len(fits) < len(examples):
        print(f"sft: skipping {len(examples) - len(fits)} of {len(examples)} {task} examples "
              f"longer than sft.seq_len={sft.seq_len}", flush=True)
    examples = fits
    order = np.random.default_rng([cfg.run.seed, 2]).permutation(len(examples))
    run_dir = sft_dir(cfg)
    writer = _writer(run_dir, cfg)
    print(f"sft: task {task}, model {getattr(cfg.model, 'hf_path', None) or cfg.model.preset} "
          f"({sharded.num_params() / 1e6:.2f}M params), mesh {dict(mesh.shape)}, batch "
          f"{sft.batch_size}x{sft.seq_len}, {sft.batch_size // micro} micro-batch(es), "
          f"{sft.steps} steps", flush=True)

    losses, times, tokens = [], [], []
    cursor, t_start = 0, time.perf_counter()
    for i in range(sft.steps):
        batch, cursor = pack_examples(examples, order, cursor, sft.batch_size, sft.seq_len)
        n_tok = int((batch["segment_ids"] != 0).sum())
        t0 = time.perf_counter()
        state, m = step(state, shd.shard_batch(batch, mesh))
        dt = time.perf_counter() - t0
        losses.append(m["loss"]); times.append(dt); tokens.append(n_tok)
        if (i + 1) % cfg.run.log_every == 0 or i in (0, sft.steps - 1):
            note = " (incl. compile)" if i == 0 else ""
            print(f"sft step {i + 1:>4}/{sft.steps}  loss {m['loss']:.4f}  grad_norm "
                  f"{m['grad_norm']:.3f}  lr {m['lr']:.2e}  tokens/s {n_tok / dt:>9,.0f}  "
                  f"{dt * 1e3:6.0f} ms{note}", flush=True)
        if writer is not None:
            writer.log_step(i, {"sft/loss": m["loss"], "sft/grad_norm": m["grad_norm"],
                                "sft/lr": m["lr"], "sft/tokens_per_s": n_tok / dt,
                                "sft/loss_tokens": float(batch["num_loss_tokens"])})

    steady = slice(1, None) if len(times) > 1 else slice(None)
    tps = float(np.sum(tokens[steady]) / np.sum(times[steady]))
    model_dir = _save(run_dir, dcfg, jax.device_get(state.params), tokenizer,
                      getattr(cfg.model, "hf_path", None))
    summary = {"task": task, "steps": sft.steps, "first_loss": losses[0], "last_loss": losses[-1],
               "losses": losses, "tokens_per_s": tps, "wall_s": time.perf_counter() - t_start,
               "run_dir": run_dir, "model_dir": model_dir}
    print(f"sft done: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {sft.steps} steps, "
          f"{tps:,.0f} tokens/s after compile, {summary['wall_s']:.1f} s; model in {model_dir}",
          flush=True)
    if writer is not None:
        writer.log_event("sft_done", first_loss=losses[0], last_loss=losses[-1],
                         tokens_per_s=tps, model_dir=model_dir)
        writer.close()
    return summary


def _writer(run_dir: str, cfg: Any):
    try:
        from laminar_jax.metrics import RunWriter
    except ImportError:
        return None
    return RunWriter(run_dir, cfg)


def _save(run_dir: str, dcfg: DecoderConfig, params: Any, tokenizer: Any,
          hf_path: str | None) -> str:
    """The trained model as a Hugging Face folder (``model.hf_path`` of a later run), with the
    tokenizer it was trained with."""
    from laminar_jax.models.hf import save_pretrained
    folder = os.path.join(run_dir, "sft_model")
    save_pretrained(folder, dcfg, params)
    if hf_path:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.exists(os.path.join(hf_path, name)):
                shutil.copy(os.path.join(hf_path, name), folder)
    else:
        tokenizer.save_pretrained(folder)
    return folder
