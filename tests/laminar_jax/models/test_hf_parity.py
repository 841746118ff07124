"""Same weights, same numbers: the JAX decoder against transformers (torch CPU, fp32)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from laminar_jax.models import attention as attn
from laminar_jax.models.decoder import from_params
from laminar_jax.models.hf import load_pretrained, params_to_hf, read_tensors, save_pretrained
from tests.laminar_jax.models.hf_fixtures import make_hf_model

VARIANTS = {
    "qwen2": dict(arch="qwen2"),
    "qwen2_tied": dict(arch="qwen2", tie_word_embeddings=True, num_kv_heads=1),
    "llama3_tied": dict(arch="llama", llama3_rope=True, rope_theta=500000.0, tie_word_embeddings=True,
                        hidden_size=128, num_heads=8),
    "qwen3": dict(arch="qwen3", head_dim=32),
}
SEQ = 40
# every attention implementation that runs on this backend ("auto" is one of them)
ATTENTION = [a for a in attn.supported() if a != "auto"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for seed, (name, kwargs) in enumerate(VARIANTS.items()):
        kwargs = dict(kwargs)
        arch = kwargs.pop("arch")
        hf_model = make_hf_model(arch, seed=seed, **kwargs)
        folder = str(tmp_path_factory.mktemp(name))
        hf_model.save_pretrained(folder)
        cfg, params = load_pretrained(folder)
        out[name] = (folder, hf_model, cfg, params, from_params(cfg, params))
    return out


def _tokens(batch, length, seed=0):
    return np.random.RandomState(seed).randint(0, 512, (batch, length)).astype(np.int32)


def _hf_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def _next_token_logp(logits, tokens):
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)[:, :-1]
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(tokens)[:, 1:, None], axis=-1)[..., 0])


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_logprobs_match_transformers(checkpoints, variant, attention):
    _, hf_model, cfg, params, _ = checkpoints[variant]
    model = from_params(cfg.replace(attention=attention), params)
    tokens = _tokens(2, SEQ)
    positions = np.tile(np.arange(SEQ, dtype=np.int32), (2, 1))
    ref = _hf_logits(hf_model, tokens)
    ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions)))
    assert np.abs(ref).max() > 1.0  # weights are wide enough for the comparison to mean something
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(_next_token_logp(ours, tokens), _next_token_logp(ref, tokens), atol=1e-4)


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("variant", ["qwen2", "llama3_tied"])
def test_packed_row_matches_unpacked_transformers(checkpoints, variant, attention):
    _, hf_model, cfg, params, _ = checkpoints[variant]
    model = from_params(cfg.replace(attention=attention), params)
    a, b = _tokens(1, 9, seed=1), _tokens(1, 13, seed=2)
    tokens = np.concatenate([a, b, np.zeros((1, 2), np.int32)], axis=1)
    positions = np.concatenate([np.arange(9), np.arange(13), [0, 0]])[None].astype(np.int32)
    segments = np.asarray([[1] * 9 + [2] * 13 + [0] * 2], np.int32)
    packed = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)))[0]
    np.testing.assert_allclose(packed[:9], _hf_logits(hf_model, a)[0], atol=1e-4)
    np.testing.assert_allclose(packed[9:22], _hf_logits(hf_model, b)[0], atol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_bit_exact(checkpoints, variant, tmp_path):
    folder, _, cfg, params, _ = checkpoints[variant]
    save_pretrained(str(tmp_path), cfg, params)
    original = load_file(os.path.join(folder, "model.safetensors"))
    written = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and written[name].shape == tensor.shape, name
        assert written[name].tobytes() == tensor.tobytes(), name
    cfg2, _ = load_pretrained(str(tmp_path))
    assert cfg2 == cfg


@pytest.mark.parametrize("variant", ["qwen2_tied", "qwen3"])
def test_transformers_loads_what_we_save(checkpoints, variant, tmp_path):
    import transformers

    _, hf_model, cfg, params, _ = checkpoints[variant]
    # Perturb so the reloaded model can only match if our writer (not the original file) is right.
    shifted = jax.tree.map(lambda x: np.asarray(x) * np.float32(1.01), params)
    save_pretrained(str(tmp_path), cfg, shifted, max_shard_bytes=40_000)
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokens = _tokens(2, 12, seed=3)
    ours = np.asarray(from_params(cfg, shifted)(jnp.asarray(tokens), jnp.tile(jnp.arange(12), (2, 1))))
    np.testing.assert_allclose(ours, _hf_logits(reloaded, tokens), atol=1e-4)
    assert not np.allclose(_hf_logits(hf_model, tokens), _hf_logits(reloaded, tokens), atol=1e-3)


def test_sharded_checkpoint_loads_like_single_file(checkpoints, tmp_path):
    folder, hf_model, cfg, params, _ = checkpoints["llama3_tied"]
    hf_model.save_pretrained(str(tmp_path), max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    cfg_sharded, params_sharded = load_pretrained(str(tmp_path))
    assert cfg_sharded == cfg
    jax.tree.map(np.testing.assert_array_equal, params_sharded, params)
    # Our own sharded writer round-trips bit-exactly through the index too.
    out = tmp_path / "ours"
    save_pretrained(str(out), cfg, params, max_shard_bytes=50_000)
    tensors, where = read_tensors(str(out))
    assert len(set(where.values()) - {where[""]}) > 1
    original = load_file(os.path.join(folder, "model.safetensors"))
    assert sorted(tensors) == sorted(original)
    assert all(tensors[n].tobytes() == original[n].tobytes() for n in original)


def test_bfloat16_export_matches_torch_cast(checkpoints, tmp_path):
    _, hf_model, cfg, params, _ = checkpoints["qwen3"]
    # Relays hand over jax or numpy trees; both must give the same bytes.
    from_numpy = params_to_hf(cfg, params, dtype="bfloat16")
    from_jax = params_to_hf(cfg, jax.tree.map(jnp.asarray, params), dtype="bfloat16")
    reference = {k: v.to(torch.bfloat16).view(torch.int16).numpy() for k, v in hf_model.state_dict().items()}
    assert sorted(from_numpy) == sorted(reference)
    for name, ref in reference.items():
        assert from_numpy[name].dtype.name == "bfloat16"
        assert from_numpy[name].view(np.int16).tobytes() == ref.tobytes(), name
        assert from_jax[name].tobytes() == from_numpy[name].tobytes(), name
    save_pretrained(str(tmp_path), cfg, params, dtype="bfloat16")
    cfg_bf16, params_bf16 = load_pretrained(str(tmp_path))
    assert cfg_bf16.param_dtype == "bfloat16" and cfg_bf16.dtype == "bfloat16"
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    again = params_to_hf(cfg_bf16, params_bf16)
    assert all(again[n].tobytes() == from_numpy[n].tobytes() for n in from_numpy)
    _, params_fp32 = load_pretrained(str(tmp_path), param_dtype="float32")
    assert params_fp32["embedding"].dtype == np.float32
