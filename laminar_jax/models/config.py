"""Decoder configuration: one frozen dataclass for the Llama / Qwen2 / Qwen3 family.

No jax import here (the CLI and config loader import this module).  `DecoderConfig.from_hf`
reads a Hugging Face `config.json` dict as written by transformers 5.x (`rope_parameters`) or
4.x (top-level `rope_theta` + `rope_scaling`); `to_hf` writes the 5.x form back.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_HF_ARCH = {v: k for k, v in ARCHITECTURES.items()}
DTYPES = ("float32", "bfloat16", "float16")
# models.attention.IMPLEMENTATIONS (repeated: this module imports no jax)
ATTENTION = ("auto", "blockwise", "cudnn", "splash", "naive", "exact")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (transformers `rope_type="llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: Literal["llama3"] = "llama3"

    def __post_init__(self):
        if self.rope_type != "llama3":
            raise ValueError(f"RopeScaling.rope_type: got {self.rope_type!r}, expected 'llama3'")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                "RopeScaling: expected high_freq_factor > low_freq_factor > 0, got "
                f"high_freq_factor={self.high_freq_factor}, low_freq_factor={self.low_freq_factor}")
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"RopeScaling: factor ({self.factor}) and original_max_position_embeddings "
                f"({self.original_max_position_embeddings}) must be > 0")


@dataclass(frozen=True)
class DecoderConfig:
    """Shape and numerics of a decoder-only transformer (pre-norm, RoPE, GQA, SwiGLU)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    param_dtype: str = "float32"
    dtype: str = "float32"
    attention: str = "auto"  # implementation, not a shape: models.attention (model.attention)

    def __post_init__(self):
        if self.arch not in _HF_ARCH:
            raise ValueError(f"DecoderConfig.arch: got {self.arch!r}, expected one of {sorted(_HF_ARCH)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DecoderConfig.{name}: got {value!r}, expected a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim: got {self.head_dim}, expected an even number (RoPE)")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(
                f"DecoderConfig: rope_theta ({self.rope_theta}) and rms_norm_eps ({self.rms_norm_eps}) must be > 0")
        if self.attention not in ATTENTION:
            raise ValueError(f"DecoderConfig.attention: got {self.attention!r}, expected one of {ATTENTION}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"DecoderConfig.{name}: got {getattr(self, name)!r}, expected one of {DTYPES}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, m, n_layers = self.hidden_size, self.intermediate_size, self.num_layers
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * m + 2 * h
        head = 0 if self.tie_word_embeddings else h * self.vocab_size
        return self.vocab_size * h + n_layers * per_layer + h + head

    def replace(self, **changes: Any) -> "DecoderConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "DecoderConfig":
        """Named shapes: "tiny" (tests, CPU runs) and "100m" (~100M params, Qwen2-style)."""
        presets = {
            "tiny": dict(arch="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0,
                         max_position_embeddings=2048, tie_word_embeddings=True, qkv_bias=True),
            "100m": dict(arch="qwen2", vocab_size=32768, hidden_size=768, intermediate_size=2048,
                         num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64, rope_theta=1e6,
                         max_position_embeddings=4096, tie_word_embeddings=True, qkv_bias=True),
        }
        if name not in presets:
            raise ValueError(f"DecoderConfig.preset: unknown preset {name!r}, expected one of {sorted(presets)}")
        return cls(**{**presets[name], **overrides})

    @classmethod
    def from_model_section(cls, model: Any, *, dtype: str | None = None) -> "DecoderConfig":
        """The preset a run config's ``model`` section names, resized to its ``vocab_size`` (0
        keeps the preset's); ``dtype`` overrides both dtypes (the rollout copy's)."""
        param_dtype, compute = (dtype, dtype) if dtype else (model.param_dtype, model.dtype)
        resize = {"vocab_size": model.vocab_size} if getattr(model, "vocab_size", 0) else {}
        attention = getattr(model, "attention", "auto")
        return cls.preset(model.preset, param_dtype=param_dtype, dtype=compute, attention=attention, **resize)

    # ------------------------------------------------------------------ Hugging Face config.json
    @classmethod
    def from_hf(cls, config: dict, source: str = "config.json", **overrides: Any) -> "DecoderConfig":
        """Build from a HF `config.json` dict; `source` names the file in error messages.

        `overrides` (e.g. `param_dtype="bfloat16"`) replace fields after parsing.
        """
        def need(key):
            if key not in config or config[key] is None:
                raise ValueError(f"{source}: missing required field {key!r}")
            return config[key]

        archs = config.get("architectures") or []
        arch_name = archs[0] if archs else None
        if arch_name is None:
            model_type = config.get("model_type")
            if model_type in _HF_ARCH:
                arch_name = _HF_ARCH[model_type]
            else:
                raise ValueError(
                    f"{source}: no 'architectures' field and model_type={model_type!r}; expected one of "
                    f"{sorted(ARCHITECTURES)}")
        if arch_name not in ARCHITECTURES:
            raise ValueError(
                f"{source}: unsupported architecture {arch_name!r} (field 'architectures'); expected one of "
                f"{sorted(ARCHITECTURES)}")
        arch = ARCHITECTURES[arch_name]

        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: unsupported hidden_act {config['hidden_act']!r}, expected 'silu'")
        if config.get("mlp_bias"):
            raise ValueError(f"{source}: unsupported mlp_bias=True")
        if arch != "qwen2" and config.get("attention_bias"):
            raise ValueError(f"{source}: unsupported attention_bias=True for {arch_name} (o_proj bias)")
        if config.get("use_sliding_window"):
            raise ValueError(f"{source}: unsupported use_sliding_window=True")
        if config.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{source}: unsupported partial_rotary_factor={config['partial_rotary_factor']}")

        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            rope_scaling = None
        elif rope_type == "llama3":
            try:
                rope_scaling = RopeScaling(
                    factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                    high_freq_factor=float(rope["high_freq_factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
            except KeyError as e:
                raise ValueError(f"{source}: llama3 rope parameters lack {e.args[0]!r}") from None
        else:
            raise ValueError(f"{source}: unsupported rope_type {rope_type!r}, expected 'default' or 'llama3'")

        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        fields = dict(
            arch=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
        )
        fields.update(overrides)
        try:
            return cls(**fields)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_hf(self) -> dict:
        """The HF `config.json` dict (transformers 5.x layout) that `from_hf` maps back to self.

        `param_dtype` / `dtype` are not HF fields; the writer records the stored tensor dtype.
        """
        if self.arch == "qwen2" and not self.qkv_bias or self.arch != "qwen2" and self.qkv_bias:
            raise ValueError(f"DecoderConfig.qkv_bias={self.qkv_bias} cannot be expressed for arch {self.arch!r}")
        if self.qk_norm != (self.arch == "qwen3"):
            raise ValueError(f"DecoderConfig.qk_norm={self.qk_norm} cannot be expressed for arch {self.arch!r}")
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(rope_type="llama3", factor=self.rope_scaling.factor,
                        low_freq_factor=self.rope_scaling.low_freq_factor,
                        high_freq_factor=self.rope_scaling.high_freq_factor,
                        original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings)
        out: dict[str, Any] = {
            "architectures": [_HF_ARCH[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
        }
        if self.arch in ("llama", "qwen3"):
            out["attention_bias"] = False
        if self.arch == "llama":
            out["mlp_bias"] = False
        if self.arch in ("qwen2", "qwen3"):
            out.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
        return out
