"""Multi-turn environments and tools (DESIGN.md "Environments"): pure python, no Ray, no JAX.

    protocol   Environment (reset(row) -> messages, step(text) -> StepResult)
    parsers    tool calls in model output: Hermes/Qwen <tool_call>{json}</tool_call>, fenced code
    tools      Tool protocol, the sandboxed Python tool
    tool_env   ToolEnv: parse calls, run tools, count errors, score the final answer
    chat       prompts and tool turns as tokens, through the tokenizer's chat template
    registry   env.name -> a factory (built-in name or "package.module:Factory")
    lookup     the synthetic tool task: a number the model can only get by calling the tool
    python_env the Python code-tool environment over a dataset's rows

The rollout worker runs them (rollout/multiturn.py); nothing here imports laminar_jax.runtime.
"""
