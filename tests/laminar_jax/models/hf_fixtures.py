"""Tiny Hugging Face checkpoints and tokenizers on disk, for tests anywhere in the repo.

    from tests.laminar_jax.models.hf_fixtures import ...   # or load by path under importlib mode

- `make_hf_tokenizer(folder)`: a byte-level BPE trained here (<= 400 ids, fits the "tiny"
  preset's 512 rows) with a ChatML chat template, saved by transformers (torch not needed).
- `make_hf_checkpoint(folder, arch)`: a random transformers model (torch), weights drawn wide
  enough that logits differ clearly between positions, saved with `save_pretrained`.
- `make_jax_checkpoint(folder, cfg)`: the same folder format written by laminar_jax only
  (no torch), for tests that just need a loadable checkpoint.
"""
from __future__ import annotations

import os

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "What is 2+3? The answer is 5. What is 12*7? The answer is 84.",
    "Solve for x: 3x + 4 = 19, so x = 5. Think step by step.",
    "<think>Let me add the numbers.</think> The final answer is \\boxed{42}.",
]

HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def make_hf_tokenizer(folder: str, vocab_size: int = 400, chat_template: str | None = CHATML_TEMPLATE) -> str:
    """Train a tiny byte-level BPE and save it as a HF tokenizer folder; returns `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template is not None:
        hf_tok.chat_template = chat_template
    hf_tok.save_pretrained(folder)
    return folder


def hf_config(arch: str, *, vocab_size: int = 512, hidden_size: int = 64, intermediate_size: int = 128,
              num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
              tie_word_embeddings: bool = False, rope_theta: float = 10000.0, llama3_rope: bool = False,
              max_position_embeddings: int = 256):
    """A transformers config object for a tiny model of `arch` ("llama" | "qwen2" | "qwen3")."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if llama3_rope:
        # Small original context so that all three frequency bands occur at head_dim 16-32.
        rope = {"rope_type": "llama3", "rope_theta": rope_theta, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[arch]
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                  rope_parameters=rope, rms_norm_eps=1e-6)
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    return cls(**kwargs)


def make_hf_model(arch: str, seed: int = 0, **config_kwargs):
    """A random transformers CausalLM (fp32, eval mode) with wide weights and non-trivial norms."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = hf_config(arch, **config_kwargs)
    model = getattr(transformers, HF_CLASSES[arch])(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 * (3.0 if "embed" in name else 1.0))
    return model


def make_hf_checkpoint(folder: str, arch: str = "qwen2", seed: int = 0, max_shard_size=None,
                       **config_kwargs) -> str:
    """Save a random tiny transformers model of `arch` to `folder`; returns `folder`."""
    model = make_hf_model(arch, seed=seed, **config_kwargs)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return folder


def make_jax_checkpoint(folder: str, cfg=None, seed: int = 0, dtype=None) -> str:
    """Save a randomly initialised laminar_jax Decoder as a HF folder (no torch); returns `folder`."""
    from flax import nnx

    from laminar_jax.models.config import DecoderConfig
    from laminar_jax.models.decoder import Decoder
    from laminar_jax.models.hf import save_pretrained

    cfg = cfg or DecoderConfig.preset("tiny")
    _, params = nnx.split(Decoder(cfg, nnx.Rngs(seed)), nnx.Param)
    os.makedirs(folder, exist_ok=True)
    save_pretrained(folder, cfg, params.to_pure_dict(), dtype=dtype)
    return folder
