"""The synthetic tool task: the answer is a number the model can get only by calling the tool.

Prompt "37?" asks for the digit stored under key 37. Values are drawn per row independently of
the key (two rows with one key hold different values), so nothing in the prompt or the training
data predicts them: the policy has to call
    <tool_call>{"name":"lookup","arguments":{}}</tool_call>
end its turn, read the result ("\\nresult: 5\\n", `chat.CHAR_TOOL_TEMPLATE`) and answer "5".
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
    args = {} if key is None else {"key": int(key)}
    return "<tool_call>" + json.dumps({"name": "lookup", "arguments": args}, separators=(",", ":")) + "</tool_call>"


class LookupTask(_tasks.SyntheticTask):
    name = "lookup"
    default_max_n = HI

    def _draw(self, rng, count):
        keys = rng.integers(LO, HI + 1, size=count)
        values = rng.integers(V_LO, V_HI + 1, size=count)
        return [{"key": int(k), "value": int(v)} for k, v in zip(keys, values)]

    def _prompt(self, params):
        return f"{params['key']}?"

    def reference(self, params):
        """The whole multi-turn response as text: call, end of turn, tool result, answer."""
        return call_text() + EOS_TEXT + char_tool_text(str(params["value"])) + str(params["value"])

    def noisy_reference(self, params, rng, noise):
        if rng.random() < noise:
            return str(int(rng.integers(V_LO, V_HI + 1)))  # a guess, no tool
        return self.reference(params)

    @staticmethod
    def score(completion: str, row: Mapping) -> float:
        """1.0 when the text after the last tool result is the row's value."""
        return float(completion.rsplit("result:", 1)[-1].split("\n", 1)[-1].strip() == str(row["value"]))


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
