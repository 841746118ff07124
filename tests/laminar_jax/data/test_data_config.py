"""DataConfig's data-module fields: validation messages and the actor-argument factories."""
from __future__ import annotations

import dataclasses
import json

import pytest

from laminar_jax.config import ConfigError, DataConfig, load_config
from laminar_jax.data import CharTokenizer, ExperienceBuffer, PromptPool, buffer_kwargs, prompt_pool_kwargs


@pytest.mark.parametrize("override,key,expected", [
    ("data.buffer_groups=0", "data.buffer_groups", ">= 1"),
    ("data.buffer_sampler=lifo", "data.buffer_sampler", "fifo, newest, uniform"),
    ("data.buffer_when_full=spill", "data.buffer_when_full", "block, drop_oldest"),
    ("data.buffer_max_staleness=-1", "data.buffer_max_staleness", "null or an int >= 0"),
    ("data.partial_every_s=0", "data.partial_every_s", "> 0"),
    ("data.num_prompts=0", "data.num_prompts", ">= 1"),
    ("reward.format_tags=[]", "reward.format_tags", "tag names"),
    ("reward.math_backend=wolfram", "reward.math_backend", "math_verify"),
])
def test_bad_values_name_the_key(override, key, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert key in str(info.value) and expected in str(info.value)


def test_builtin_task_pool_is_tokenized_with_the_char_tokenizer():
    cfg = DataConfig(task="arithmetic", num_prompts=6, group_size=3, max_epochs=1)
    pool = PromptPool(**prompt_pool_kwargs(cfg, seed=4))
    groups = pool.issue(10, "r0")
    assert len(groups) == 6 and all(g.group_size == 3 for g in groups)
    assert all(CharTokenizer().decode(g.prompt_tokens) == g.prompt for g in groups)
    again = PromptPool(**prompt_pool_kwargs(cfg, seed=4)).issue(10, "r0")
    assert [g.prompt for g in again] == [g.prompt for g in groups]
    chat = PromptPool(**prompt_pool_kwargs(dataclasses.replace(cfg, chat_template=True), seed=4)).issue(10, "r0")
    assert [g.prompt_tokens.tolist() for g in chat] == [g.prompt_tokens.tolist() for g in groups]


def test_file_pool_and_buffer_from_config(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}"}) for i in range(3)))
    pool = PromptPool(**prompt_pool_kwargs(DataConfig(task="qa", path=str(path)), encode=lambda t: [len(t)]))
    assert [int(g.prompt_tokens[0]) for g in pool.issue(3, "r")] == [2, 2, 2]
    buf = ExperienceBuffer(**buffer_kwargs(DataConfig(buffer_groups=3, buffer_sampler="newest",
                                                      buffer_when_full="drop_oldest", buffer_max_staleness=2)))
    assert (buf.capacity_groups, buf.max_staleness) == (3, 2)
