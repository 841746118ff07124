"""The bad-input catalogue: every input `laminar train` / `laminar sft` can check before Ray starts
fails with exit code 2 and one line naming the file, key or row, and the runtime is never entered.

The CLI runs in-process with the runtime's entry replaced by a recorder (so "never entered" is
observable and costs nothing); real files throughout (truncated safetensors, garbage Parquet,
non-UTF-8 bytes, a real closed port). A few cases also run in a fresh interpreter to show that no
heavy module (jax, ray) was even imported.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types

import numpy as np
import pytest
from safetensors.numpy import save_file

from laminar_jax import cli
from laminar_jax.data.char_tokenizer import CharTokenizer
from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.hf import INDEX_FILE, SINGLE_FILE, name_map
from laminar_jax.models.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT = os.path.join(REPO, "configs", "default.yaml")
TINY = dict(arch="qwen2", vocab_size=128, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
            num_kv_heads=1, head_dim=8, max_position_embeddings=512, tie_word_embeddings=True, qkv_bias=True)


def write_model(folder, *, shards=1, tokenizer=True, **overrides):
    """A real Hugging Face folder (zero weights) for a tiny qwen2 decoder; returns its path."""
    os.makedirs(folder, exist_ok=True)
    cfg = DecoderConfig(**{**TINY, **overrides})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f)
    tensors = {e.hf_name: np.zeros(e.hf_shape, np.float32) for e in name_map(cfg)}
    if shards == 1:
        save_file(tensors, os.path.join(folder, SINGLE_FILE), metadata={"format": "pt"})
    else:
        names, weight_map = sorted(tensors), {}
        for k in range(shards):
            shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[k::shards]}
            save_file(part, os.path.join(folder, shard), metadata={"format": "pt"})
            weight_map.update({n: shard for n in part})
        with open(os.path.join(folder, INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    if tokenizer:
        CharTokenizer().save_pretrained(folder)
    return str(folder)


def write_rows(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


GOOD_ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every file the cases point at, built once."""
    d = tmp_path_factory.mktemp("bad_input")
    w = types.SimpleNamespace(dir=d)
    w.good_model = write_model(d / "good_model")
    w.rows = write_rows(d / "rows.jsonl", GOOD_ROWS)
    w.empty = d / "empty.jsonl"
    w.empty.write_text("")
    w.garbage_parquet = d / "garbage.parquet"
    w.garbage_parquet.write_bytes(os.urandom(256))
    w.bad_json = d / "bad.jsonl"
    w.bad_json.write_text('{"prompt": "a"\n{not json}\n')
    w.latin1 = d / "latin1.jsonl"
    w.latin1.write_bytes(b'{"prompt": "caf\xe9"}\n{"prompt": "na\xefve"}\n')
    w.latin1_array = d / "latin1.json"
    w.latin1_array.write_bytes(b'[\n{"prompt": "caf\xe9"}\n]\n')
    w.no_prompt = write_rows(d / "no_prompt.jsonl", [{"question": "q"}])
    w.csv = d / "rows.csv"
    w.csv.write_text("prompt\nx\n")
    w.a_file = d / "a_file"
    w.a_file.write_text("x")
    w.long_rows = write_rows(d / "long.jsonl", [{"prompt": "x" * 300, "answer": "1"}] * 3)
    w.mixed_rows = d / "mixed.jsonl"
    w.mixed_rows.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff"}\n'
                             + ('{"prompt": "%s"}\n' % ("y" * 240)).encode())

    w.no_config = d / "no_config"
    w.no_config.mkdir()
    w.bad_config = write_model(d / "bad_config")
    w.bad_config_file = os.path.join(w.bad_config, "config.json")
    with open(w.bad_config_file, "w") as f:
        f.write("{ not json")
    w.no_weights = write_model(d / "no_weights")
    os.remove(os.path.join(w.no_weights, SINGLE_FILE))
    w.garbage_weights = write_model(d / "garbage_weights")
    with open(os.path.join(w.garbage_weights, SINGLE_FILE), "wb") as f:
        f.write(os.urandom(4096))
    w.truncated = write_model(d / "truncated", shards=2)
    w.truncated_shard = os.path.join(w.truncated, "model-00002-of-00002.safetensors")
    size = os.path.getsize(w.truncated_shard)
    with open(w.truncated_shard, "r+b") as f:
        f.truncate(size - 100)
    w.lost_shard = write_model(d / "lost_shard", shards=2)
    os.remove(os.path.join(w.lost_shard, "model-00001-of-00002.safetensors"))
    w.contradiction = write_model(d / "contradiction")
    w.unsupported = write_model(d / "unsupported")
    for folder, patch in ((w.contradiction, {"model_type": "llama"}),
                          (w.unsupported, {"architectures": ["GPT2LMHeadModel"]})):
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            data = json.load(f)
        with open(path, "w") as f:
            json.dump({**data, **patch}, f)
    w.small_vocab = write_model(d / "small_vocab", vocab_size=64)  # the tokenizer has 99 ids
    w.wrong_shape = write_model(d / "wrong_shape")
    cfg_path = os.path.join(w.wrong_shape, "config.json")
    with open(cfg_path) as f:
        data = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump({**data, "intermediate_size": 48}, f)
    w.bad_tokenizer = write_model(d / "bad_tokenizer")
    with open(os.path.join(w.bad_tokenizer, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": 7}')
    # A port nothing listens on: bound but never listening (so connects are refused), and held
    # for the module so no other process can take it meanwhile.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    w.closed_port = held.getsockname()[1]
    yield w
    held.close()


def rows_at(w, path):
    return [f"data.path={path}", "reward.fn=exact_match", "data.task=math"]


def model_at(folder, w):
    return [f"model.hf_path={folder}", *rows_at(w, w.rows)]


# (id, argv after the command given the world, fragments the one-line message must hold)
CASES = [
    # data
    ("dataset-missing", lambda w: rows_at(w, w.dir / "nope.jsonl"), ["data.path", "nope.jsonl", "no such dataset file"]),
    ("dataset-empty", lambda w: rows_at(w, w.empty), ["data.path", "empty.jsonl", "no usable prompt rows"]),
    ("parquet-garbage", lambda w: rows_at(w, w.garbage_parquet), ["garbage.parquet", "cannot read Parquet"]),
    ("jsonl-all-invalid", lambda w: rows_at(w, w.bad_json), ["bad.jsonl", "line 1: invalid JSON"]),
    ("jsonl-not-utf8", lambda w: rows_at(w, w.latin1), ["latin1.jsonl", "line 1: not UTF-8 (byte 0xe9"]),
    ("json-array-not-utf8", lambda w: rows_at(w, w.latin1_array), ["latin1.json", "line 2: not UTF-8"]),
    ("rows-without-prompt", lambda w: rows_at(w, w.no_prompt), ["no_prompt.jsonl", "no field 'prompt'"]),
    ("prompt-field-typo", lambda w: rows_at(w, w.rows) + ["data.prompt_field=question"],
     ["rows.jsonl", "no field 'question'"]),
    ("dataset-format", lambda w: rows_at(w, w.csv), ["rows.csv", "unknown dataset format"]),
    ("task-unknown", lambda w: ["data.task=sudoku"], ["data.task", "'sudoku' is not a built-in task"]),
    # model folder
    ("model-missing", lambda w: model_at(w.dir / "nomodel", w), ["model.hf_path", "nomodel: no such model folder"]),
    ("model-no-config", lambda w: model_at(w.no_config, w), ["no_config/config.json: not found"]),
    ("model-config-garbage", lambda w: model_at(w.bad_config, w), ["bad_config/config.json: invalid JSON"]),
    ("model-no-weights", lambda w: model_at(w.no_weights, w), ["no_weights: neither model.safetensors"]),
    ("weights-garbage", lambda w: model_at(w.garbage_weights, w),
     ["garbage_weights/model.safetensors: not a safetensors file"]),
    ("shard-truncated", lambda w: model_at(w.truncated, w),
     ["truncated/model-00002-of-00002.safetensors: truncated"]),
    ("shard-lost", lambda w: model_at(w.lost_shard, w), ["shard 'model-00001-of-00002.safetensors' not found"]),
    ("model-type-contradicts", lambda w: model_at(w.contradiction, w),
     ["contradiction/config.json", "model_type 'llama' contradicts architectures ['Qwen2ForCausalLM']"]),
    ("architecture-unsupported", lambda w: model_at(w.unsupported, w),
     ["unsupported/config.json", "unsupported architecture 'GPT2LMHeadModel'"]),
    ("tensor-shape", lambda w: model_at(w.wrong_shape, w), ["wrong_shape/model.safetensors", "mlp.gate_proj.weight",
                                                            "has shape (32, 16), expected (48, 16)"]),
    ("tokenizer-larger-than-vocab", lambda w: model_at(w.small_vocab, w),
     ["small_vocab", "token ids go up to 98", "vocab_size=64"]),
    ("tokenizer-garbage", lambda w: model_at(w.bad_tokenizer, w), ["bad_tokenizer/tokenizer.json: cannot load"]),
    ("preset-vocab-too-small", lambda w: ["model.vocab_size=50"], ["model.vocab_size", "50 rows", "99 ids"]),
    # run folder, weight store, mesh, machine, cluster
    ("store-dir-unwritable", lambda w: [f"relay.store_dir={w.a_file}/sub"], ["relay.store_dir", "a_file/sub",
                                                                             "not a writable folder"]),
    ("out-dir-unwritable", lambda w: [f"run.out_dir={w.a_file}/runs"], ["run.out_dir", "not a writable folder"]),
    ("mesh-does-not-divide", lambda w: ["mesh.data=3"], ["mesh.data", "3 batch shards", "64 sequences"]),
    ("micro-batch-does-not-divide", lambda w: ["learner.micro_batch_size=5"], ["learner.micro_batch_size",
                                                                               "5 does not divide"]),
    ("gpus-on-cpu", lambda w: ["rollout.accelerators_per_rollout=1"], ["rollout.accelerators_per_rollout",
                                                                      "shows no GPU or TPU"]),
    ("ray-address-syntax", lambda w: ["run.ray_address=not an address"], ["run.ray_address", "is not an address"]),
    ("ray-address-port", lambda w: ["run.ray_address=127.0.0.1:99999"], ["run.ray_address", "is not an address"]),
    ("ray-address-unreachable", lambda w: [f"run.ray_address=127.0.0.1:{w.closed_port}"],
     lambda w: ["run.ray_address", f"127.0.0.1:{w.closed_port}", "cannot connect"]),
    # lengths, rewards, overrides
    ("every-prompt-too-long", lambda w: rows_at(w, w.long_rows), ["learner.max_seq_len", "3 of 3 prompts",
                                                                  "256 - rollout.max_new_tokens=64 = 192"]),
    ("max-seq-len-below-new-tokens", lambda w: ["learner.max_seq_len=32", "rollout.max_new_tokens=64"],
     ["learner.max_seq_len", "32 leaves no room for a prompt before rollout.max_new_tokens=64"]),
    ("every-builtin-prompt-too-long", lambda w: ["learner.max_seq_len=65", "rollout.max_new_tokens=64"],
     ["learner.max_seq_len", "2048 of 2048 prompts", "= 1 tokens"]),
    ("reward-typo-builtin-task", lambda w: ["reward.fn=mathh"], ["reward.fn 'mathh'", "not a built-in reward"]),
    ("reward-module-missing", lambda w: ["reward.fn=no_such_pkg.rewards:score"],
     ["reward.fn 'no_such_pkg.rewards:score'", "cannot import module"]),
    ("reward-attribute-missing", lambda w: ["reward.fn=laminar_jax.rewards.builtin:nope"], ["has no attribute 'nope'"]),
]


@pytest.fixture
def runtime_entry(monkeypatch):
    """Replaces the runtime and SFT entries with recorders: a case passes only if neither runs."""
    calls = []
    for name in ("laminar_jax.runtime.driver", "laminar_jax.learner.sft"):
        module = types.ModuleType(name)
        module.run = lambda cfg, **kw: calls.append((cfg, kw))
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # the accelerator case, on any machine
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def _one_line_error(capsys):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("case_id, argv, fragments", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_before_ray_with_one_line(world, runtime_entry, capsys, case_id, argv, fragments):
    rc = cli.main(["train", DEFAULT, *map(str, argv(world))])
    line = _one_line_error(capsys)
    assert rc == 2, line
    for fragment in (fragments(world) if callable(fragments) else fragments):
        assert fragment in line, (fragment, line)
    assert line.startswith(f"error: {DEFAULT}: ") or "no such" in line
    assert runtime_entry == [], "the runtime was entered"


def test_override_without_equals_is_named_as_such(runtime_entry, capsys):
    assert cli.main(["train", "optimizer.lr"]) == 2
    assert _one_line_error(capsys) == ("error: 'optimizer.lr' is neither a config file nor an override: "
                                       "an override needs '=', e.g. optimizer.lr=VALUE")
    assert cli.main(["train", DEFAULT, "optimizer.lr"]) == 2
    assert "override 'optimizer.lr': expected KEY=VALUE" in _one_line_error(capsys)
    assert runtime_entry == []


def test_sft_checks_its_model_before_starting(world, runtime_entry, capsys):
    assert cli.main(["sft", DEFAULT, f"model.hf_path={world.truncated}"]) == 2
    assert "model-00002-of-00002.safetensors: truncated" in _one_line_error(capsys)
    assert runtime_entry == []


def test_survivable_input_warns_with_file_and_line_and_the_run_goes_on(world, runtime_entry, capsys):
    """One non-UTF-8 row and one prompt too long: skipped / counted, one warning line each."""
    rc = cli.main(["train", DEFAULT, *rows_at(world, world.mixed_rows)])
    assert rc == 0 and len(runtime_entry) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"warning: {world.mixed_rows}: 1 bad rows skipped, 2 kept "
                      "(first: line 2: not UTF-8 (byte 0xff at column 13))")
    assert err[1].startswith(f"warning: {DEFAULT}: 1 of 2 prompts are longer than learner.max_seq_len=256")
    assert f"{world.mixed_rows} line 3" in err[1] and len(err) == 2


def test_good_model_folder_passes(world, runtime_entry, capsys):
    assert cli.main(["train", DEFAULT, *model_at(world.good_model, world)]) == 0
    assert len(runtime_entry) == 1 and capsys.readouterr().err == ""


def test_train_reuses_the_checked_dataset_and_prompt_lengths(world, runtime_entry):
    """The run gets the rows and prompt lengths the checks loaded (it would load and encode them
    again otherwise); the lengths are the model's tokenizer's."""
    assert cli.main(["train", DEFAULT, *model_at(world.good_model, world)]) == 0
    ((cfg, kw),) = runtime_entry
    inputs = kw["inputs"]
    assert [r.prompt for r in inputs.dataset.rows] == [r["prompt"] for r in GOOD_ROWS]
    tok = load_tokenizer(str(world.good_model))
    assert inputs.prompt_lengths == [len(tok.encode(r["prompt"])) for r in GOOD_ROWS]
    # without a model folder the SFT warm-up makes the tokenizer later: no lengths yet
    runtime_entry.clear()
    assert cli.main(["train", DEFAULT, *rows_at(world, world.rows)]) == 0
    assert runtime_entry[0][1]["inputs"].prompt_lengths is None


_PROBE = """
import json, sys
from laminar_jax.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "heavy": sorted(m for m in ("jax", "ray", "flax", "torch") if m in sys.modules)}))
"""


@pytest.mark.parametrize("case_id", ["shard-truncated", "reward-typo-builtin-task", "ray-address-unreachable"])
def test_bad_input_imports_neither_jax_nor_ray(world, case_id):
    argv = next(c[1] for c in CASES if c[0] == case_id)(world)
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", _PROBE, "train", DEFAULT, *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"rc": 2, "heavy": []}, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
