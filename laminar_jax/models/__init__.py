"""Decoder models (Llama / Qwen2 / Qwen3), Hugging Face checkpoints and tokenizers.

Import the submodules directly: `models.config` has no jax import (CLI-safe); `models.decoder`
and `models.layers` need jax; `models.hf` and `models.tokenizer` need numpy only.
"""
