"""A character tokenizer for the built-in tasks, exportable as a Hugging Face `tokenizer.json`.

One token per character of printable ASCII plus newline, and three special tokens: `<pad>` (0),
`</s>` (1, end of sequence), `<unk>` (2, any other character). No BOS is added. The pure-python
`encode` / `decode` here and the exported `tokenizers.Tokenizer` (WordLevel model, a split that
isolates every character, a Fuse decoder) give the same ids and text, so the engines and the model
loader can treat the tiny task like any Hugging Face model folder.
"""
from __future__ import annotations

import json
import os
import re
from typing import Sequence

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)
CHARACTERS = tuple(chr(i) for i in range(32, 127)) + ("\n",)
# A trivial chat template: the user's text as is, so chat_template=true leaves prompts unchanged.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


class CharTokenizer:
    """Character-level tokenizer (module docstring). Picklable; no state beyond the vocabulary."""

    def __init__(self):
        self.vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
        self.id_to_token = {i: tok for tok, i in self.vocab.items()}
        self._special_re = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))

    pad_token_id = 0
    eos_token_id = 1
    unk_token_id = 2
    stop_token_ids = (1,)

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special-token strings inside the text map to their ids (as in HF)."""
        ids: list[int] = []
        pos = 0
        for match in self._special_re.finditer(text):
            ids.extend(self.vocab.get(c, self.unk_token_id) for c in text[pos:match.start()])
            ids.append(self.vocab[match.group()])
            pos = match.end()
        ids.extend(self.vocab.get(c, self.unk_token_id) for c in text[pos:])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            tok = self.id_to_token.get(int(i))
            if tok is None:
                # A model's vocabulary is often padded past the tokenizer's; a sampled padding id
                # decodes to U+FFFD so the completion stays visibly wrong instead of crashing.
                out.append("\ufffd")
                continue
            if skip_special_tokens and tok in SPECIAL_TOKENS:
                continue
            out.append(tok)
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs) -> str | list[int]:
        """`CHAT_TEMPLATE` rendered: the messages' contents concatenated (no role markers)."""
        text = "".join(str(m["content"]) for m in messages)
        return self.encode(text) if tokenize else text

    def to_hf(self):
        """The same tokenizer as a `tokenizers.Tokenizer`."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel(dict(self.vocab), unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
        return tok

    def save_pretrained(self, folder: str) -> list[str]:
        """Write `tokenizer.json` and `tokenizer_config.json` (special tokens, chat template)."""
        os.makedirs(folder, exist_ok=True)
        paths = [os.path.join(folder, "tokenizer.json"), os.path.join(folder, "tokenizer_config.json")]
        self.to_hf().save(paths[0])
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "pad_token": PAD, "eos_token": EOS, "unk_token": UNK,
            "add_bos_token": False, "add_eos_token": False,
            "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        }
        with open(paths[1], "w") as f:
            json.dump(config, f, indent=2)
        return paths
