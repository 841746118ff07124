"""env.name: python. The Python code tool over a dataset's rows.

The model runs code by writing a fenced ```python block or a Hermes call
`<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`; the observation is the
sandboxed run's stdout (or its error). A turn without a call is the final answer: reward 1 when
it equals the row's `answer` (surrounding whitespace ignored), else 0.
"""
from __future__ import annotations

from laminar_jax.env.tool_env import ToolEnv
from laminar_jax.env.tools import PythonTool


class PythonEnv(ToolEnv):
    def tools(self, row):
        return {"python": PythonTool(timeout_s=self.tool_timeout_s)}

    def prompt(self, row):
        return str(row.get("prompt", ""))

    def score(self, text, row):
        return float(text.strip() == str(row.get("answer", "")).strip())
