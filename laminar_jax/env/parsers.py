"""Tool calls in model output, in the two common formats.

Hermes / Qwen (the format of Qwen2.5 / Qwen3 chat templates and the Hermes function-calling
models): `<tool_call>{"name": "...", "arguments": {...}}</tool_call>`, one JSON object per tag;
`arguments` may also be a JSON-encoded string (some models emit it so).
Fenced code blocks: ```python ... ``` (or ```py, or an untagged fence) become a call of the code
tool, `{"code": <block>}`.

`parse_tool_calls(text)` returns the calls in the order they appear; a malformed one (bad JSON,
no name, an unclosed tag) is a `ParseError` in its place, so the environment can answer it with
an error observation and count it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"
FENCE_RE = re.compile(r"```(python|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    format: str = "hermes"   # hermes | code


@dataclass(frozen=True)
class ParseError:
    error: str
    text: str = ""


def _hermes(body: str) -> ToolCall | ParseError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ParseError(f"tool call is not valid JSON ({e.msg} at char {e.pos})", body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ParseError('tool call needs {"name": <string>, "arguments": {...}}', body)
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ParseError("tool call arguments are a string that is not JSON", body)
    if not isinstance(args, dict):
        return ParseError(f"tool call arguments must be an object, got {type(args).__name__}", body)
    return ToolCall(obj["name"], args, "hermes")


def parse_tool_calls(text: str, *, code_tool: str | None = "python") -> list[ToolCall | ParseError]:
    """Every tool call in `text`, in order (module docstring). code_tool: the tool a fenced code
    block calls; None leaves fences alone."""
    found: list[tuple[int, ToolCall | ParseError]] = []
    end = 0
    for m in HERMES_RE.finditer(text):
        found.append((m.start(), _hermes(m.group(1).strip())))
        end = m.end()
    tail = text.find(OPEN_TAG, end)
    if tail >= 0:
        found.append((tail, ParseError("unclosed <tool_call> tag", text[tail:tail + 200])))
    if code_tool is not None:
        spans = [(m.start(), m.end()) for m in HERMES_RE.finditer(text)]
        for m in FENCE_RE.finditer(text):
            if not any(a <= m.start() < b for a, b in spans):  # a fence inside a JSON call is its own
                found.append((m.start(), ToolCall(code_tool, {"code": m.group(2)}, "code")))
    return [call for _, call in sorted(found, key=lambda x: x[0])]
