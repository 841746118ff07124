"""DecoderConfig: parsing transformers' config.json, the inverse, presets and validation."""
import json
import math

import pytest

from laminar_jax.models.config import DecoderConfig, RopeScaling
from tests.laminar_jax.models.hf_fixtures import hf_config


def _written_config(tmp_path, arch, **kwargs) -> dict:
    """config.json exactly as transformers 5 writes it."""
    hf_config(arch, **kwargs).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("arch,kwargs,expected", [
    ("llama", dict(llama3_rope=True, rope_theta=500000.0, tie_word_embeddings=True),
     dict(qkv_bias=False, qk_norm=False, head_dim=16, tie_word_embeddings=True, rope_theta=500000.0,
          rope_scaling=RopeScaling(4.0, 1.0, 4.0, 32))),
    ("qwen2", dict(rope_theta=1e6), dict(qkv_bias=True, qk_norm=False, head_dim=16, rope_theta=1e6)),
    ("qwen3", dict(head_dim=32), dict(qkv_bias=False, qk_norm=True, head_dim=32)),
])
def test_from_hf_reads_transformers_config(tmp_path, arch, kwargs, expected):
    raw = _written_config(tmp_path, arch, **kwargs)
    cfg = DecoderConfig.from_hf(raw, source=str(tmp_path / "config.json"))
    want = dict(arch=arch, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
                max_position_embeddings=256, rms_norm_eps=1e-6)
    want.update(expected)
    for name, value in want.items():
        assert getattr(cfg, name) == value, name
    # to_hf is the inverse, and transformers accepts what it writes.
    assert DecoderConfig.from_hf(cfg.to_hf()) == cfg
    import transformers
    reparsed = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
    assert reparsed.num_key_value_heads == cfg.num_kv_heads
    assert reparsed.head_dim == cfg.head_dim
    assert reparsed.rope_parameters["rope_theta"] == cfg.rope_theta


def test_from_hf_reads_transformers4_rope_layout():
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
    cfg = DecoderConfig.from_hf(raw)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert cfg.head_dim == 8 and cfg.num_kv_heads == 2


@pytest.mark.parametrize("change,fragment", [
    ({"architectures": ["MistralForCausalLM"]}, "'MistralForCausalLM'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "'yarn'"),
    ({"hidden_act": "gelu"}, "'gelu'"),
    ({"vocab_size": None}, "'vocab_size'"),
    ({"num_key_value_heads": 3}, "num_kv_heads (3)"),
])
def test_from_hf_errors_name_file_and_value(tmp_path, change, fragment):
    raw = {**_written_config(tmp_path, "qwen2"), **change}
    with pytest.raises(ValueError) as err:
        DecoderConfig.from_hf(raw, source="/ckpt/config.json")
    assert "/ckpt/config.json" in str(err.value)
    assert fragment in str(err.value)


def test_presets_and_param_count():
    tiny = DecoderConfig.preset("tiny")
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_heads, tiny.num_kv_heads, tiny.head_dim,
            tiny.vocab_size) == (2, 128, 4, 2, 32, 512)
    big = DecoderConfig.preset("100m")
    assert 90e6 < big.num_params() < 110e6
    # num_params against the arrays a Decoder actually allocates (shapes only, nothing computed).
    from flax import nnx

    from laminar_jax.models.decoder import Decoder
    for cfg in (tiny, big, tiny.replace(tie_word_embeddings=False, qkv_bias=False, qk_norm=True, arch="qwen3")):
        state = nnx.state(nnx.eval_shape(lambda: Decoder(cfg)), nnx.Param)
        count = sum(math.prod(x.shape) for x in __import__("jax").tree.leaves(state))
        assert count == cfg.num_params()
    with pytest.raises(ValueError, match="'huge'"):
        DecoderConfig.preset("huge")


@pytest.mark.parametrize("field,value", [("arch", "gpt2"), ("head_dim", 0), ("dtype", "int8"),
                                          ("num_kv_heads", 3)])
def test_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        DecoderConfig.preset("tiny", **{field: value})


def test_to_hf_refuses_inexpressible_combinations():
    with pytest.raises(ValueError, match="qkv_bias"):
        DecoderConfig.preset("tiny", arch="llama").to_hf()  # tiny has qkv_bias=True
