"""ToolEnv: the common environment of tool-calling tasks.

reset(row) opens with one user message (`prompt(row)`). Each step parses the policy's turn for
tool calls (`parsers.parse_tool_calls`):
- no call: the turn is the final answer; the episode ends with reward `score(text, row)`;
- calls: each runs (up to the calls left of `max_tool_calls`); the observation is their results,
  one line each; a malformed call, an unknown tool, or a tool that raises gets an error line
  (`error: ...`) and is counted (parse_errors / tool_errors), and the episode goes on.
Subclasses define `tools(row)`, `prompt(row)` and `score(text, row)`.

snapshot() / restore(row, state) (`protocol`): the state between steps is the count of calls
made; the tools are rebuilt from the row (a subclass whose tools keep their own state between
calls extends both).
"""
from __future__ import annotations

from typing import Any, Mapping

from laminar_jax.env.parsers import ParseError, ToolCall, parse_tool_calls
from laminar_jax.env.protocol import StepResult
from laminar_jax.env.tools import ToolError


class ToolEnv:
    code_tool: str | None = "python"   # the tool a fenced code block calls (None: fences are text)

    def __init__(self, cfg: Any = None):
        self.max_tool_calls = getattr(cfg, "max_tool_calls", 4)
        self.tool_timeout_s = getattr(cfg, "tool_timeout_s", 5.0)
        self.row: Mapping[str, Any] = {}
        self.calls = 0
        self._tools: dict = {}

    # subclasses
    def tools(self, row: Mapping[str, Any]) -> dict:
        raise NotImplementedError

    def prompt(self, row: Mapping[str, Any]) -> str:
        return str(row.get("prompt", ""))

    def score(self, text: str, row: Mapping[str, Any]) -> float:
        raise NotImplementedError

    def is_correct_call(self, call: ToolCall, row: Mapping[str, Any]) -> bool:
        """Whether a call is the one the task needs (logged as correct_tool_calls)."""
        return False

    # protocol
    def reset(self, row: Mapping[str, Any]) -> list[dict]:
        self.row, self.calls = row, 0
        self._tools = self.tools(row)
        return [{"role": "user", "content": self.prompt(row)}]

    def snapshot(self) -> dict:
        return {"calls": self.calls}

    def restore(self, row: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        calls = state.get("calls") if isinstance(state, Mapping) else None
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
            raise ValueError(f'{type(self).__name__}.restore: expected {{"calls": <int >= 0>}}, got {state!r:.200}')
        self.reset(row)
        self.calls = calls

    def step(self, action_text: str) -> StepResult:
        calls = parse_tool_calls(action_text, code_tool=self.code_tool)
        if not calls:
            return StepResult(None, float(self.score(action_text, self.row)), True, {})
        info = {"tool_calls": 0, "tool_errors": 0, "parse_errors": 0, "correct_tool_calls": 0}
        lines = []
        for call in calls:
            if self.calls >= self.max_tool_calls:
                lines.append(f"error: tool call limit of {self.max_tool_calls} reached")
                break
            self.calls += 1
            info["tool_calls"] += 1
            if isinstance(call, ParseError):
                info["parse_errors"] += 1
                lines.append(f"error: {call.error}")
                continue
            tool = self._tools.get(call.name)
            if tool is None:
                info["tool_errors"] += 1
                lines.append(f"error: unknown tool {call.name!r} (tools: {', '.join(sorted(self._tools))})")
                continue
            try:
                lines.append(str(tool(call.arguments)).strip())
                info["correct_tool_calls"] += int(self.is_correct_call(call, self.row))
            except ToolError as e:
                info["tool_errors"] += 1
                lines.append(f"error: {e}")
        return StepResult("\n".join(lines), 0.0, False, info)
