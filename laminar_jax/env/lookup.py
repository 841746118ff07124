"""The synthetic tool task: the answer is a number the model can get only by calling the tool.

Prompt "37?" asks for the digit stored under key 37. Values are drawn per row independently of
the key (two rows with one key hold different values), so nothing in the prompt or the training
data predicts them: the policy has to call
    <tool_call>{"name":"lookup"}</tool_call>
end its turn, read the result ("\\nresult: 5", `chat.CHAR_TOOL_TEMPLATE`) and answer "5".
Reward 1 for the right value, else 0; a guess without the tool is right 1 time in 10. (Values
are one digit: the 2-layer tiny model copies one token from a tool result after a short
warm-up, while copying two took it far longer than a CPU test can wait; for the same reason the
demonstrated call names no key: the tool serves the row's own key, and a key given must be it.)

`LookupTask` gives the prompts and the supervised warm-up (`laminar sft`, run by `laminar train`
when no model is given): with probability `noise` (sft.demo_noise) a demonstration answers at
once with a guess, so the warm policy calls the tool only part of the time, and RL raises it.
`LookupEnv` is the environment (env.name: lookup).
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

from laminar_jax.data import tasks as _tasks
from laminar_jax.env.chat import char_tool_text
from laminar_jax.env.parsers import ToolCall
from laminar_jax.env.tool_env import ToolEnv
from laminar_jax.env.tools import ToolError

EOS_TEXT = "</s>"
LO, HI = 10, 99   # keys: two-digit numbers
V_LO, V_HI = 0, 9  # values: one digit


def call_text(key: int | None = None) -> str:
    """The call the demonstrations make (no key: the tool serves the row's key) or, with a key,
    the call naming it."""
    call = {"name": "lookup"} if key is None else {"name": "lookup", "arguments": {"key": int(key)}}
    return "<tool_call>" + json.dumps(call, separators=(",", ":")) + "</tool_call>"


class LookupTask(_tasks.SyntheticTask):
    name = "lookup"
    default_max_n = HI

    def _draw(self, rng, count):
        keys = rng.integers(LO, HI + 1, size=count)
        values = rng.integers(V_LO, V_HI + 1, size=count)
        return [{"key": int(k), "value": int(v)} for k, v in zip(keys, values)]

    def _prompt(self, params):
        return f"{params['key']}?"

    def segments(self, params) -> list[tuple[str, bool]]:
        """The whole multi-turn response as (text, written by the policy): the call and its end
        of turn, the tool result (the environment's: not a target), the answer copying it."""
        value = str(params["value"])
        return [(call_text() + EOS_TEXT, True), (char_tool_text(value), False), (value, True)]

    def reference(self, params):
        return "".join(text for text, _ in self.segments(params))

    def noisy_segments(self, params, rng, noise) -> list[tuple[str, bool]]:
        if rng.random() < noise:
            return [(str(int(rng.integers(V_LO, V_HI + 1))), True)]  # a guess, no tool
        return self.segments(params)

    def noisy_reference(self, params, rng, noise):
        return "".join(text for text, _ in self.noisy_segments(params, rng, noise))

    def sft_examples(self, n: int, seed: int = 0, noise: float = 0.0) -> list[_tasks.SftExample]:
        """As `SyntheticTask.sft_examples` (the same draws), with a `response_mask` that is 0 on
        the tool result: the warm-up learns to call and to copy, never to predict the tool's
        output (the SFT twin of the rollout's loss mask 0 on tool tokens)."""
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"task {self.name}: demonstration noise must be in [0, 1), got {noise}")
        rng, noise_rng = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 3])
        tok, out = self.tokenizer, []
        for params in self._draw(rng, n):
            prompt = self._prompt(params)
            parts = self.noisy_segments(params, noise_rng, noise) if noise else self.segments(params)
            ids = [tok.encode(text) for text, _ in parts] + [[tok.eos_token_id]]
            mask = [float(trained) for (_, trained), t in zip(parts + [("", True)], ids) for _ in t]
            out.append(_tasks.SftExample(prompt, "".join(t for t, _ in parts), np.asarray(tok.encode(prompt), np.int64),
                                         np.asarray([i for t in ids for i in t], np.int64),
                                         np.asarray(mask, np.float32)))
        return out

    @staticmethod
    def score(completion: str, row: Mapping) -> float:
        """1.0 when the text after the tool result (or the whole text, with no call) is the row's
        value."""
        value, tool = str(row["value"]), char_tool_text(str(row["value"]))
        return float(completion.rsplit(tool, 1)[-1].strip() == value if tool in completion
                     else completion.strip() == value)


_tasks.TASKS.setdefault(LookupTask.name, LookupTask)


class LookupTool:
    name = "lookup"

    def __init__(self, table: Mapping[int, int]):
        self.table = dict(table)

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        if "key" not in arguments and len(self.table) == 1:
            return str(next(iter(self.table.values())))
        key = arguments.get("key")
        try:
            key = int(key)
        except (TypeError, ValueError):
            raise ToolError(f'lookup: expected {{"key": <integer>}}, got {dict(arguments)}') from None
        if key not in self.table:
            raise ToolError(f"lookup: no key {key}")
        return str(self.table[key])


class LookupEnv(ToolEnv):
    """env.name: lookup. The tool knows only this row's key (another key is an error)."""

    code_tool = None

    def tools(self, row):
        return {"lookup": LookupTool({int(row["key"]): int(row["value"])})}

    def prompt(self, row):
        return f"{row['key']}?"

    def score(self, text, row):
        return float(text.strip() == str(row["value"]))

    def is_correct_call(self, call: ToolCall, row) -> bool:
        return call.name == "lookup" and str(call.arguments.get("key", row["key"])) == str(row["key"])
