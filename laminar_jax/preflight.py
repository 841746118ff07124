"""Checks that run before Ray starts: every input a `laminar train` / `laminar sft` run reads that
can be checked without a cluster, so a bad input costs a second and one line, not a Ray start,
an SFT warm-up and a 100-line traceback.

`check_train(cfg, source=...)` / `check_sft(cfg, source=...)` raise `PreflightError` (a
`ConfigError`: the CLI prints `error: <message>` and exits 2) naming the config file and the
dotted key, file or row at fault; they return warnings (one line each) for what the run survives,
e.g. skipped dataset rows or prompts too long for the context. `train_inputs(cfg, source=...)`
runs the same checks and also returns what they loaded (the dataset, every prompt's length), so
the run does not load and encode them a second time. No jax or ray import here.

Checked: run.ray_address (syntax, and that something listens there), accelerators asked for on
a machine that shows none, the learner's mesh against the batch, relay.store_dir and run.out_dir
writable, reward.fn resolvable, the model folder (config.json, architectures vs model_type, every
safetensors shard's header and tensor shapes), the tokenizer against the model's vocabulary, the
dataset (missing, empty, unreadable; bad rows reported), and prompt lengths against
learner.max_seq_len - rollout.max_new_tokens.
"""
from __future__ import annotations

import glob
import os
import re
import socket
import tempfile
from typing import Any, Mapping, NamedTuple

from laminar_jax.config_loader import ConfigError

# How long a probe of run.ray_address may take: an unreachable cluster is an error within it.
RAY_PROBE_TIMEOUT_S = 5.0
_ADDRESS_RE = re.compile(r"^(?:ray://)?(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*):(?P<port>\d{1,5})$")


class PreflightError(ConfigError):
    """An input of the run is unusable; the message names the file, key or row."""


def _fail(source: str, key: str, text: str) -> PreflightError:
    return PreflightError(f"{source}: {key}: {text}")


# ------------------------------------------------------------------ cluster and machine
def check_ray_address(cfg: Any, source: str, environ: Mapping[str, str] = os.environ) -> None:
    """`auto` or `[ray://]host:port`, with something accepting connections at host:port."""
    address = environ.get("RAY_ADDRESS") or cfg.run.ray_address
    if not address:
        return
    key = "RAY_ADDRESS (environment)" if environ.get("RAY_ADDRESS") else "run.ray_address"
    if address == "auto":
        return  # Ray finds the local cluster itself, and says so when there is none
    m = _ADDRESS_RE.match(address)
    if not m or not 0 < int(m.group("port")) < 65536:
        raise _fail(source, key, f"{address!r} is not an address; expected 'auto', 'host:port' or "
                                 "'ray://host:port'")
    host, port = m.group("host").strip("[]"), int(m.group("port"))
    try:
        with socket.create_connection((host, port), timeout=RAY_PROBE_TIMEOUT_S):
            pass
    except OSError as e:
        raise _fail(source, key, f"{address!r}: cannot connect within {RAY_PROBE_TIMEOUT_S:.0f} s "
                                 f"({type(e).__name__}: {e.strerror or e}); is the Ray cluster up?") from None


def visible_accelerators(environ: Mapping[str, str] = os.environ) -> int:
    """GPUs / TPU chips this machine shows (device files), honouring CUDA_VISIBLE_DEVICES."""
    cuda = environ.get("CUDA_VISIBLE_DEVICES")
    if cuda is not None and cuda.strip() in ("", "-1", "none", "NoDevFiles"):
        gpus = 0
    else:
        gpus = len(glob.glob("/dev/nvidia[0-9]*"))
        if cuda:
            gpus = min(gpus, len(cuda.split(",")))
    return gpus + len(glob.glob("/dev/accel[0-9]*")) + len(glob.glob("/dev/vfio/[0-9]*"))


def check_accelerators(cfg: Any, source: str, environ: Mapping[str, str] = os.environ) -> None:
    """Accelerators asked for by an embedded run (no cluster to join) on a machine without any."""
    want = cfg.rollout.accelerators_per_rollout
    if want <= 0 or environ.get("RAY_ADDRESS") or cfg.run.ray_address:
        return
    if visible_accelerators(environ) == 0:
        raise _fail(source, "rollout.accelerators_per_rollout",
                    f"{want} asked for, but this machine shows no GPU or TPU (no /dev/nvidia*, /dev/accel*; "
                    f"CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES')!r}); use 0 on CPU or set "
                    "run.ray_address to a cluster that has them")


def check_mesh(cfg: Any, source: str) -> None:
    """The learner's mini-batch and micro-batch split evenly over the mesh's batch shards.

    Mirrors `runtime.rl_step.build` (mini-batch rows = global_batch_groups / mini_batches x
    group_size; micro-batch a divisor of it and a multiple of data x fsdp). `mesh.data = -1`
    depends on the devices Ray gives the learner, so it is left to the learner.
    """
    mesh, learner = cfg.mesh, cfg.learner
    if mesh.data == -1:
        return
    rows = learner.global_batch_groups // learner.mini_batches * cfg.data.group_size
    shards = mesh.data * mesh.fsdp
    micro = learner.micro_batch_size or rows
    what = (f"a mini-batch of {rows} sequences (learner.global_batch_groups={learner.global_batch_groups}"
            f" / learner.mini_batches={learner.mini_batches} x data.group_size={cfg.data.group_size})")
    if rows % micro:
        raise _fail(source, "learner.micro_batch_size", f"{micro} does not divide {what}")
    if micro % shards:
        raise _fail(source, "mesh.data", f"mesh data={mesh.data} x fsdp={mesh.fsdp} = {shards} batch shards "
                                         f"do not divide {'the micro-batch of ' + str(micro) if micro != rows else what}")


def check_writable(path: str, source: str, key: str) -> None:
    """`path` is a folder this process can write in, or can be created: a temporary file is made
    and removed in its nearest existing ancestor (nothing is left behind)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        if not os.path.isdir(probe):
            raise NotADirectoryError(20, f"{probe} is a file")
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise _fail(source, key, f"{path!r} is not a writable folder ({type(e).__name__}: "
                                 f"{e.strerror or e})") from None


# ------------------------------------------------------------------ reward, model, tokenizer
def check_reward(cfg: Any, source: str):
    from laminar_jax.rewards.registry import resolve_reward
    try:
        return resolve_reward(cfg.reward, answer_field=cfg.data.answer_field)
    except ConfigError as e:
        raise PreflightError(f"{source}: {e}") from None


def check_model(cfg: Any, source: str, *, hf_path: str | None = None):
    """(DecoderConfig, tokenizer) of the run: the folder's (checked without loading weights) or
    the preset's with the built-in tasks' character tokenizer."""
    from laminar_jax.models.config import DecoderConfig
    hf_path = hf_path or cfg.model.hf_path
    if hf_path is None:
        from laminar_jax.data.char_tokenizer import CharTokenizer
        try:
            mcfg = DecoderConfig.from_model_section(cfg.model)
        except ValueError as e:
            raise _fail(source, "model", str(e)) from None
        tok = CharTokenizer()
        if len(tok) > mcfg.vocab_size:
            raise _fail(source, "model.vocab_size", f"{mcfg.vocab_size} rows for the built-in tasks' character "
                                                    f"tokenizer of {len(tok)} ids; use 0 or >= {len(tok)}")
        return mcfg, tok
    from laminar_jax.models.hf import check_folder
    try:
        mcfg = check_folder(hf_path)
    except (OSError, ValueError) as e:
        raise _fail(source, "model.hf_path", str(e).replace("\n", " ")) from None
    tok_file = os.path.join(hf_path, "tokenizer.json")
    if not os.path.exists(tok_file):
        from laminar_jax.data.char_tokenizer import CharTokenizer
        tok = CharTokenizer()
        if len(tok) > mcfg.vocab_size:
            raise _fail(source, "model.hf_path", f"{hf_path} has no tokenizer.json, and the character tokenizer's "
                                                 f"{len(tok)} ids do not fit its vocab_size={mcfg.vocab_size}")
        return mcfg, tok
    from laminar_jax.models.tokenizer import check_vocab, load_tokenizer
    try:
        tok = load_tokenizer(hf_path)
    except ValueError as e:
        raise _fail(source, "model.hf_path", str(e)) from None
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception type
        raise _fail(source, "model.hf_path", f"{tok_file}: cannot load ({type(e).__name__}: "
                                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    try:
        check_vocab(tok, mcfg, model_source=os.path.join(hf_path, "config.json"))
    except ValueError as e:
        raise _fail(source, "model.hf_path", str(e)) from None
    return mcfg, tok


# ------------------------------------------------------------------ data
def check_dataset(cfg: Any, source: str):
    """The loaded dataset and a warning line when rows were skipped."""
    from laminar_jax.data.datasets import DatasetError, load_dataset
    key = "data.path" if cfg.data.path is not None else "data.task"
    try:
        dataset = load_dataset(cfg.data, seed=cfg.run.seed)
    except DatasetError as e:
        raise _fail(source, key, str(e).removeprefix(f"{key}: ")) from None
    warnings = []
    if dataset.bad_rows:
        b = dataset.bad_rows[0]
        warnings.append(f"{dataset.source}: {dataset.num_bad} bad rows skipped, {len(dataset.rows)} kept "
                        f"(first: {b.location}: {b.reason})")
    return dataset, warnings


def check_prompt_lengths(cfg: Any, source: str, dataset, tokenizer, mcfg) -> tuple[list[str], list[int]]:
    """Prompts with no room for rollout.max_new_tokens in the context: an error if all are, else
    a warning with the count (the rollouts reject those groups; the learner never sees them).
    Returns (warnings, each prompt's length in tokens)."""
    from laminar_jax.data.prompt_pool import PromptEncoder
    max_len = min(mcfg.max_position_embeddings, cfg.learner.max_seq_len)
    room = max_len - cfg.rollout.max_new_tokens
    if room <= 0:
        raise _fail(source, "learner.max_seq_len", f"{cfg.learner.max_seq_len}"
                    f"{f' (model max_position_embeddings={mcfg.max_position_embeddings})' if max_len < cfg.learner.max_seq_len else ''}"
                    f" leaves no room for a prompt before rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
    encode = PromptEncoder(tokenizer, chat_template=cfg.data.chat_template)
    try:
        lengths = [len(encode(r.prompt)) for r in dataset.rows]
    except Exception as e:  # noqa: BLE001 - a chat template may raise anything
        raise _fail(source, "data.chat_template", f"cannot render prompts ({type(e).__name__}: {e})") from None
    too_long = [(n, r) for n, r in zip(lengths, dataset.rows) if n > room]
    if not too_long:
        return [], lengths
    longest, row = max(too_long, key=lambda x: x[0])
    text = (f"{len(too_long)} of {len(lengths)} prompts are longer than learner.max_seq_len={cfg.learner.max_seq_len}"
            f"{f' (model max_position_embeddings={mcfg.max_position_embeddings})' if mcfg.max_position_embeddings < cfg.learner.max_seq_len else ''}"
            f" - rollout.max_new_tokens={cfg.rollout.max_new_tokens} = {room} tokens (longest: {longest} tokens, "
            f"{row.source or row.prompt_id})")
    if len(too_long) == len(lengths):
        raise _fail(source, "learner.max_seq_len", text + "; raise learner.max_seq_len or lower rollout.max_new_tokens")
    return [f"{source}: {text}; their groups will be rejected"], lengths


# ------------------------------------------------------------------ entry points
class TrainInputs(NamedTuple):
    """What `train_inputs` checked, for the run to reuse (`driver.run(..., inputs=)`)."""
    warnings: list[str]
    dataset: Any               # data.datasets.LoadedDataset: the prompts, bad rows left out
    prompt_lengths: list[int] | None   # tokens of each prompt as the rollouts encode it; None with
                                       # the SFT warm-up (its model folder and tokenizer come later)


def check_train(cfg: Any, *, source: str = "<config>", environ: Mapping[str, str] = os.environ) -> list[str]:
    """Every pre-Ray check of `laminar train`; returns warning lines, raises `PreflightError`."""
    return train_inputs(cfg, source=source, environ=environ).warnings


def train_inputs(cfg: Any, *, source: str = "<config>", environ: Mapping[str, str] = os.environ) -> TrainInputs:
    """`check_train`, keeping the dataset and prompt lengths it loaded and measured."""
    check_ray_address(cfg, source, environ)
    check_accelerators(cfg, source, environ)
    check_mesh(cfg, source)
    check_writable(cfg.run.out_dir, source, "run.out_dir")
    check_writable(cfg.relay.store_dir, source, "relay.store_dir")
    check_reward(cfg, source)
    mcfg, tokenizer = check_model(cfg, source)
    dataset, warnings = check_dataset(cfg, source)
    too_long, lengths = check_prompt_lengths(cfg, source, dataset, tokenizer, mcfg)
    return TrainInputs(warnings + too_long, dataset, lengths if cfg.model.hf_path is not None else None)


def check_sft(cfg: Any, *, source: str = "<config>") -> list[str]:
    """The pre-start checks of `laminar sft`: output folder and model (folder or preset)."""
    check_writable(cfg.run.out_dir, source, "run.out_dir")
    check_model(cfg, source)
    return []
