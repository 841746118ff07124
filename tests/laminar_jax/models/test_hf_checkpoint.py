"""HF folder reader/writer without torch: the name map and every bad-input error."""
import json
import os
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.hf import (hf_to_params, load_pretrained, name_map, params_to_hf, read_tensors,
                                   save_pretrained)
from tests.laminar_jax.models.hf_fixtures import make_jax_checkpoint

CFG = DecoderConfig.preset("tiny", num_layers=2, hidden_size=64, intermediate_size=96, num_heads=4,
                           num_kv_heads=2, head_dim=16, vocab_size=128, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ckpt"))
    make_jax_checkpoint(folder, CFG, seed=0)
    return folder


@pytest.fixture
def copy(source, tmp_path):
    """A writable copy of the checkpoint: (folder, tensors dict)."""
    for name in os.listdir(source):
        (tmp_path / name).write_bytes(open(os.path.join(source, name), "rb").read())
    return str(tmp_path), load_file(str(tmp_path / "model.safetensors"))


def _rewrite(folder, tensors):
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def test_name_map_is_one_to_one_and_inverse(source):
    cfg, params = load_pretrained(source)
    entries = name_map(cfg)
    assert len({e.hf_name for e in entries}) == len(entries)
    assert len({(e.path, e.layer) for e in entries}) == len(entries)
    tensors = params_to_hf(cfg, params)
    assert {n: t.shape for n, t in tensors.items()} == {e.hf_name: e.hf_shape for e in entries}
    back = hf_to_params(cfg, tensors)
    assert back.keys() == params.keys() and back["layers"].keys() == params["layers"].keys()
    for key in params["layers"]:
        np.testing.assert_array_equal(back["layers"][key], params["layers"][key])
    # Per-head layout: HF row block h of q_proj is our head h (the view transformers applies).
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(q[2 * cfg.head_dim:3 * cfg.head_dim], params["layers"]["q_kernel"][1][:, 2, :].T)
    o = tensors["model.layers.0.self_attn.o_proj.weight"]
    np.testing.assert_array_equal(o[:, cfg.head_dim:2 * cfg.head_dim], params["layers"]["o_kernel"][0][1].T)


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "config.json"))):
        load_pretrained(str(tmp_path))


def test_unknown_architecture_names_file_and_value(copy):
    folder, _ = copy
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    json.dump({**config, "architectures": ["GPT2LMHeadModel"]}, open(path, "w"))
    with pytest.raises(ValueError, match=re.escape(path) + ".*'GPT2LMHeadModel'"):
        load_pretrained(folder)


def test_no_weight_files(copy):
    folder, _ = copy
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(folder)


def test_missing_tensor(copy):
    folder, tensors = copy
    del tensors["model.layers.1.mlp.up_proj.weight"]
    _rewrite(folder, tensors)
    with pytest.raises(ValueError) as err:
        load_pretrained(folder)
    msg = str(err.value)
    assert os.path.join(folder, "model.safetensors") in msg
    assert "'model.layers.1.mlp.up_proj.weight'" in msg and "(96, 64)" in msg


def test_unexpected_tensor(copy):
    folder, tensors = copy
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    _rewrite(folder, tensors)
    with pytest.raises(ValueError, match=re.escape(os.path.join(folder, "model.safetensors"))
                       + ".*unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"):
        load_pretrained(folder)


def test_misshaped_tensor_names_expected_and_actual(copy):
    folder, tensors = copy
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
    _rewrite(folder, tensors)
    with pytest.raises(ValueError) as err:
        load_pretrained(folder)
    msg = str(err.value)
    assert os.path.join(folder, "model.safetensors") in msg and "'model.layers.0.self_attn.k_proj.weight'" in msg
    assert "(64, 64)" in msg and "expected (32, 64)" in msg


def test_error_in_a_shard_names_the_shard(source, tmp_path):
    cfg, params = load_pretrained(source)
    save_pretrained(str(tmp_path), cfg, params, max_shard_bytes=20_000)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    shard = index["weight_map"]["model.norm.weight"]
    tensors = load_file(str(tmp_path / shard))
    tensors["model.norm.weight"] = np.ones(63, np.float32)
    save_file(tensors, str(tmp_path / shard))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / shard)) + ".*'model.norm.weight'.*\\(63,\\)"):
        load_pretrained(str(tmp_path))
    # A stale shard from an earlier save is removed by the next save.
    save_pretrained(str(tmp_path), cfg, params)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert read_tensors(str(tmp_path))[0].keys() == params_to_hf(cfg, params).keys()


def test_tied_head_stored_explicitly(tmp_path):
    cfg = CFG.replace(tie_word_embeddings=True)
    make_jax_checkpoint(str(tmp_path), cfg)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    same = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].copy()}
    np.testing.assert_array_equal(hf_to_params(cfg, same)["embedding"], tensors["model.embed_tokens.weight"])
    differs = {**same, "lm_head.weight": same["lm_head.weight"] + 1}
    with pytest.raises(ValueError, match="x.safetensors: tensor 'lm_head.weight' differs"):
        hf_to_params(cfg, differs, source="x.safetensors")


def test_params_tree_missing_entry(source):
    cfg, params = load_pretrained(source)
    del params["layers"]["mlp_norm"]
    with pytest.raises(KeyError, match="layers/mlp_norm"):
        params_to_hf(cfg, params)
