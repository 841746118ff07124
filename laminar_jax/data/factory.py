"""Constructor arguments of the data actors from a `DataConfig`.

Ray wraps the classes as actors (`ray.remote(PromptPool).remote(**prompt_pool_kwargs(...))`), so
these return keyword arguments rather than instances; `PromptPool(**kwargs)` works in-process.
"""
from __future__ import annotations

from typing import Callable, Sequence

from laminar_jax.data.char_tokenizer import CharTokenizer
from laminar_jax.data.datasets import LoadedDataset, load_dataset
from laminar_jax.data.prompt_pool import PromptEncoder


def prompt_pool_kwargs(cfg, *, seed: int = 0, encode: Callable[[str], Sequence[int]] | None = None,
                       dataset: LoadedDataset | None = None) -> dict:
    """Arguments of `PromptPool` for `cfg` (a `DataConfig`); loads the dataset unless given.

    encode=None uses the built-in tasks' `CharTokenizer` for a built-in task (cfg.path unset) and
    leaves prompts untokenized for a file dataset.
    """
    dataset = dataset if dataset is not None else load_dataset(cfg, seed=seed)
    if encode is None and cfg.path is None:
        encode = PromptEncoder(CharTokenizer(), chat_template=cfg.chat_template)
    return dict(rows=list(dataset.rows), group_size=cfg.group_size, seed=seed, shuffle=cfg.shuffle,
                max_epochs=cfg.max_epochs, encode=encode, name=dataset.source)


def buffer_kwargs(cfg, *, seed: int = 0) -> dict:
    """Arguments of `ExperienceBuffer` for `cfg` (a `DataConfig`)."""
    return dict(capacity_groups=cfg.buffer_groups, sampler=cfg.buffer_sampler, eviction=cfg.buffer_when_full,
                max_staleness=cfg.buffer_max_staleness, seed=seed)
