"""Prompts and tool turns as tokens, through the tokenizer's own chat template.

A tokenizer with a chat template that has roles (a Hugging Face model's): the prompt is
`apply_chat_template(messages, add_generation_prompt=True)`, and a tool turn is the text the
template adds for `{"role": "tool", "content": observation}` plus the next assistant header:
render(messages + [assistant, tool], generation prompt) minus render(messages + [assistant]).
The policy's own turn is never re-rendered (its sampled tokens stay as they were).

The built-in char tokenizer's template has no roles (it concatenates contents), so there the
fixed template `CHAR_TOOL_TEMPLATE` wraps a tool result: "\\nresult: <observation>", and the
policy's next turn follows the observation's last character directly (no newline after it: an
answer that copies a short result is then "repeat the current token", which a 2-layer model
learns in a short warm-up; copying a token from one position back took it far longer). The
synthetic lookup task's demonstrations use the same function, so SFT and RL see one format.
"""
from __future__ import annotations

from typing import Sequence

from laminar_jax.data.char_tokenizer import CHAT_TEMPLATE as CHAR_CHAT_TEMPLATE

CHAR_TOOL_TEMPLATE = "\nresult: {observation}"


def has_role_template(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks roles (not None, not the char tokenizer's)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and template != CHAR_CHAT_TEMPLATE


def encode(tokenizer, text: str) -> list[int]:
    """Ids of text with no special tokens added (an HF tokenizer would add a BOS)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # CharTokenizer.encode takes no flag and adds nothing
        return list(tokenizer.encode(text))


def prompt_tokens(tokenizer, messages: Sequence[dict]) -> list[int]:
    if has_role_template(tokenizer):
        return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True))
    return encode(tokenizer, "".join(str(m["content"]) for m in messages))


def char_tool_text(observation: str) -> str:
    return CHAR_TOOL_TEMPLATE.format(observation=observation)


def tool_turn_tokens(tokenizer, messages: Sequence[dict], assistant_text: str, observation: str) -> list[int]:
    """Tokens between the policy's turn and its next turn (module docstring)."""
    if not has_role_template(tokenizer):
        return encode(tokenizer, char_tool_text(observation))
    before = list(messages) + [{"role": "assistant", "content": assistant_text}]
    head = tokenizer.apply_chat_template(before, add_generation_prompt=False, tokenize=False)
    full = tokenizer.apply_chat_template(before + [{"role": "tool", "content": observation}],
                                         add_generation_prompt=True, tokenize=False)
    if not full.startswith(head):
        raise ValueError("chat template: rendering a tool message changed the text before it; "
                         "this template cannot extend a conversation turn by turn")
    return encode(tokenizer, full[len(head):])
