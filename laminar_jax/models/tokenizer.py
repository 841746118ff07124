"""Tokenizer from a local Hugging Face folder, without transformers.

Reads `tokenizer.json` (the `tokenizers` library), `tokenizer_config.json` (bos / eos / pad
tokens, maybe `chat_template`), `chat_template.jinja` (where transformers >= 4.5x saves the
template) and `generation_config.json` (extra eos ids). Chat templates render in a sandboxed
jinja2 environment set up as transformers sets it up (`trim_blocks`, `lstrip_blocks`,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape), with the
special tokens (`bos_token`, `eos_token`, ...) in scope.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any, Sequence

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or serialized AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


@lru_cache(maxsize=16)
def _compile_template(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


@dataclass
class HFTokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of its folder."""

    tokenizer: Tokenizer
    special_tokens: dict[str, str] = field(default_factory=dict)
    chat_template: str | None = None
    generation_eos_ids: tuple[int, ...] = ()
    source: str = "tokenizer"

    # ------------------------------------------------------------------ special tokens
    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        """The pad token's id, falling back to eos (as RL pipelines usually do)."""
        pad = self.token_id(self.pad_token)
        return pad if pad is not None else self.eos_token_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """eos id plus any extra eos ids from generation_config.json (e.g. Qwen's <|endoftext|>)."""
        ids = [] if self.eos_token_id is None else [self.eos_token_id]
        return tuple(dict.fromkeys(ids + list(self.generation_eos_ids)))

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_id(self) -> int:
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values())

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render `messages` with the folder's chat template (ids if `tokenize`, no extra specials)."""
        if self.chat_template is None:
            raise ValueError(
                f"{self.source}: no chat template (looked in {TOKENIZER_CONFIG_FILE} and {CHAT_TEMPLATE_FILE})")
        variables = {**self.special_tokens, **kwargs}
        text = _compile_template(self.chat_template).render(
            messages=messages, tools=variables.pop("tools", None), documents=variables.pop("documents", None),
            add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from None


def load_tokenizer(folder: str) -> HFTokenizer:
    """Load the tokenizer of a local HF folder (see module docstring for the files read)."""
    path = os.path.join(folder, TOKENIZER_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: not found (only fast tokenizers, i.e. tokenizer.json, are supported)")
    tokenizer = Tokenizer.from_file(path)
    config_path = os.path.join(folder, TOKENIZER_CONFIG_FILE)
    config = _read_json(config_path)
    special = {k: _token_text(config[k]) for k in _SPECIAL_KEYS if _token_text(config.get(k)) is not None}
    for key, token in special.items():
        if tokenizer.token_to_id(token) is None:
            raise ValueError(f"{config_path}: {key} {token!r} is not in the vocabulary of {path}")

    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    jinja_path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.exists(jinja_path):
        with open(jinja_path) as f:
            template = f.read()

    gen_eos = _read_json(os.path.join(folder, GENERATION_CONFIG_FILE)).get("eos_token_id")
    gen_eos = () if gen_eos is None else tuple(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return HFTokenizer(tokenizer, special, template, tuple(int(i) for i in gen_eos), source=folder)


def check_vocab(tokenizer: HFTokenizer, cfg, model_source: str = "model config") -> None:
    """Raise ValueError unless every token id of `tokenizer` is a row of the model's embedding."""
    max_id = tokenizer.max_token_id
    if max_id >= cfg.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.source}: token ids go up to {max_id} ({len(tokenizer)} tokens) but "
            f"{model_source} has vocab_size={cfg.vocab_size}; the tokenizer does not fit the model")
