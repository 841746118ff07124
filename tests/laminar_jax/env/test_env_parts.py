"""The environment package: tool-call parsing, the sandboxed Python tool, ToolEnv's error
observations and counts, the registry and env config checks, and the lookup task."""
import json

import numpy as np
import pytest

from laminar_jax.config import ConfigError, load_config
from laminar_jax.data.char_tokenizer import CharTokenizer
from laminar_jax.data.tasks import TASKS, get_task
from laminar_jax.env import chat
from laminar_jax.env.lookup import LookupEnv, LookupTask, call_text
from laminar_jax.env.parsers import ParseError, ToolCall, parse_tool_calls
from laminar_jax.env.python_env import PythonEnv
from laminar_jax.env.registry import EnvSpecError, resolve_env
from laminar_jax.env.tools import PythonTool, ToolError
from laminar_jax.rewards.sandbox import run_code

ROW = {"key": 37, "value": 52}


def test_parses_hermes_calls_and_fences_in_order():
    text = ('think <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> then\n```python\nprint(2)\n```'
            ' and <tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
    calls = parse_tool_calls(text)
    assert calls == [ToolCall("a", {"x": 1}), ToolCall("python", {"code": "print(2)\n"}, "code"),
                     ToolCall("b", {"y": 2})]
    assert parse_tool_calls("```\nx = 1\n```") == [ToolCall("python", {"code": "x = 1\n"}, "code")]
    assert parse_tool_calls("```python\nx\n```", code_tool=None) == []
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize("text,error", [
    ("<tool_call>{bad json}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "needs {\"name\""),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "must be an object"),
    ('<tool_call>{"name": "a"', "unclosed"),
])
def test_malformed_calls_are_parse_errors(text, error):
    (call,) = parse_tool_calls(text)
    assert isinstance(call, ParseError) and error in call.error


def test_tool_env_answers_bad_calls_with_errors_and_counts_them():
    env = LookupEnv(load_config(None, ["env.max_tool_calls=4"]).env)
    assert env.reset(ROW) == [{"role": "user", "content": "37?"}]
    obs, reward, done, info = env.step(call_text(37))
    assert (obs, reward, done) == ("52", 0.0, False) and info["correct_tool_calls"] == 1
    obs, _, _, info = env.step(call_text())  # no key: the tool serves the row's key
    assert obs == "52" and info["correct_tool_calls"] == 1
    obs, _, done, info = env.step('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert "unknown tool 'search'" in obs and info["tool_errors"] == 1 and not done
    obs, _, _, info = env.step("<tool_call>{oops}</tool_call>")
    assert obs.startswith("error: tool call is not valid JSON") and info["parse_errors"] == 1
    obs, _, _, info = env.step(call_text(37))  # the 5th call is past max_tool_calls=4
    assert "limit of 4" in obs and info["tool_calls"] == 0
    assert env.step(" 52 ")[1:3] == (1.0, True) and env.step("51")[1] == 0.0


def test_python_tool_runs_in_the_sandbox_with_its_timeout():
    if run_code("print(1)").status == "unavailable":
        pytest.skip("no network namespace here: the sandbox refuses to run code")
    tool = PythonTool(timeout_s=1.0)
    assert tool({"code": "print(6 * 7)"}).strip() == "42"
    with pytest.raises(ToolError, match="timeout"):
        tool({"code": "while True: pass"})
    with pytest.raises(ToolError, match="error"):
        tool({"code": "raise SystemExit(3)"})
    with pytest.raises(ToolError, match="expected"):
        tool({})
    env = PythonEnv(load_config(None, ["env.name=python", "env.tool_timeout_s=1"]).env)
    env.reset({"prompt": "6*7?", "answer": "42"})
    obs, _, done, info = env.step("```python\nprint(6*7)\n```")
    assert obs == "42" and not done and info["tool_calls"] == 1
    obs, _, _, info = env.step("```python\nimport time\ntime.sleep(5)\n```")
    assert "timeout" in obs and info["tool_errors"] == 1
    assert env.step("42")[1:3] == (1.0, True)


class NoStep:
    def __init__(self, cfg):
        pass

    def reset(self, row):
        return []


def test_registry_and_config_checks():
    cfg = load_config(None, ["env.name=lookup"]).env
    assert isinstance(resolve_env(cfg)(), LookupEnv)
    user = load_config(None, ["env.name=laminar_jax.env.python_env:PythonEnv"]).env
    assert isinstance(resolve_env(user)(), PythonEnv)
    with pytest.raises(EnvSpecError, match="env.name 'nope': not a built-in"):
        resolve_env(load_config(None, ["env.name=nope"]).env)
    with pytest.raises(EnvSpecError, match="cannot import module 'no_such_mod'"):
        resolve_env(load_config(None, ["env.name=no_such_mod:Env"]).env)
    with pytest.raises(EnvSpecError, match="no step method"):
        resolve_env(load_config(None, [f"env.name={__name__}:NoStep"]).env)
    for bad, key in (("env.max_turns=0", "env.max_turns"), ("env.tool_timeout_s=0", "env.tool_timeout_s"),
                     ("env.name=a.b", "env.name")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="env.max_total_tokens"):
        load_config(None, ["env.name=lookup", "env.max_total_tokens=256", "learner.max_seq_len=256"])


def test_lookup_task_needs_the_tool_and_its_demos_match_the_rl_format():
    assert TASKS["lookup"] is LookupTask
    task = get_task("lookup", num_prompts=500)
    rows = task.rows()
    by_key: dict = {}
    for r in rows:
        assert r.prompt == f"{r.row['key']}?"
        by_key.setdefault(r.row["key"], set()).add(r.row["value"])
    assert max(len(v) for v in by_key.values()) > 1, "one key holds several values: not memorisable"
    tok = CharTokenizer()
    (demo,) = task.sft_examples(1)
    p = demo.prompt_tokens.tolist()
    assert p == chat.prompt_tokens(tok, LookupEnv().reset({"key": int(demo.prompt[:-1]), "value": 0}))
    # the demo = policy turn + EOS, the tool turn exactly as the rollout renders it, the answer + EOS
    resp = demo.response_tokens.tolist()
    cut = resp.index(tok.eos_token_id) + 1
    key = int(demo.prompt[:-1])
    assert tok.decode(resp[:cut]) == call_text() and key
    obs_tokens = chat.tool_turn_tokens(tok, [], call_text(), "52")
    assert tok.decode(obs_tokens) == "\nresult: 52" and resp[cut:cut + 9] == obs_tokens[:9]
    noisy = task.sft_examples(200, noise=0.5)
    calls = np.mean([tok.decode(e.response_tokens).startswith("<tool_call>") for e in noisy])
    assert 0.35 < calls < 0.65
    assert json.loads(call_text(5)[len("<tool_call>"):-len("</tool_call>")])["arguments"] == {"key": 5}
    # the task's own score of a whole completion: the text after the tool result, or the guess
    full = call_text() + "</s>" + chat.char_tool_text("7") + "7"
    assert LookupTask.score(full, {"value": 7}) == 1.0 and LookupTask.score(full + "7", {"value": 7}) == 0.0
    assert LookupTask.score(" 7\n", {"value": 7}) == 1.0 and LookupTask.score("3", {"value": 7}) == 0.0



def test_lookup_demos_mask_the_tool_result_in_the_warm_up_loss():
    """The warm-up trains the call and the answer that copies the result, never the result itself
    (the SFT twin of the rollout's loss mask 0 on tool tokens); the draws are the base task's."""
    from laminar_jax.data.tasks import SyntheticTask
    from laminar_jax.learner.sft import pack_examples
    tok, task = CharTokenizer(), get_task("lookup")
    demos = task.sft_examples(64, seed=3, noise=0.5)
    plain = SyntheticTask.sft_examples(task, 64, seed=3, noise=0.5)
    assert [d.response for d in demos] == [p.response for p in plain]
    for d in demos:
        resp, mask = d.response_tokens.tolist(), d.response_mask
        assert len(mask) == len(resp) and mask[-1] == 1 and resp[-1] == tok.eos_token_id
        if not d.response.startswith("<tool_call>"):
            assert mask.all()   # a guess: every token is the policy's
            continue
        cut = resp.index(tok.eos_token_id) + 1
        value = d.response[-1]
        obs = chat.tool_turn_tokens(tok, [], call_text(), value)
        assert resp[cut:cut + len(obs)] == obs
        np.testing.assert_array_equal(mask, [1] * cut + [0] * len(obs) + [1] * (len(resp) - cut - len(obs)))
    batch, nxt = pack_examples(demos, np.arange(len(demos)), 0, batch_size=4, seq_len=88)
    assert batch["num_loss_tokens"] == sum(d.response_mask.sum() for d in demos[:nxt])
    assert batch["num_loss_tokens"] < sum(len(d.response_tokens) for d in demos[:nxt])
