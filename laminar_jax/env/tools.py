"""Tools an environment calls: `tool(arguments) -> text`, raising `ToolError` for a failure the
model should see (bad arguments, a crash); the text of either is the observation.

`PythonTool` runs the code in the sandbox of `laminar_jax.rewards.sandbox` (its own process
group and temp dir, CPU / memory / file-size rlimits, no network) and kills it at `timeout_s`.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol

from laminar_jax.rewards.sandbox import run_code


class ToolError(Exception):
    """A tool call that failed in a way the model is told about (and that is counted)."""


class Tool(Protocol):
    name: str

    def __call__(self, arguments: Mapping[str, Any]) -> str: ...


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


class PythonTool:
    """Run `arguments["code"]` in the sandbox; the observation is its stdout (clipped to
    `max_output_chars`); a non-zero exit, timeout or limit raises ToolError with the reason and
    the last stderr line."""

    name = "python"

    def __init__(self, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 1024):
        self.timeout_s, self.memory_mb, self.max_output_chars = timeout_s, memory_mb, max_output_chars

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError('python: expected {"code": "<python source>"}')
        result = run_code(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        if not result.ok:
            last = next((ln for ln in reversed(result.stderr.strip().splitlines()) if ln.strip()), "")
            raise ToolError(_clip(f"python: {result.status}: {result.detail or last}", self.max_output_chars))
        return _clip(result.stdout, self.max_output_chars)
