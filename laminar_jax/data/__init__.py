"""Data module: prompt pool, partial-response pool, experience buffer, datasets and tasks.

Pure python + numpy, no jax or Ray: the runtime wraps `PromptPool`, `PartialPool` and
`ExperienceBuffer` as Ray actors; their methods take and return the plain records of
`laminar_jax.data.records`, and each has `state_dict()` / `load_state_dict()` (JSON-safe).
"""
from laminar_jax.data.buffer import BufferedGroup, ExperienceBuffer, ledger_balance
from laminar_jax.data.char_tokenizer import CharTokenizer
from laminar_jax.data.datasets import BadRow, DatasetError, LoadedDataset, load_dataset, load_prompt_file
from laminar_jax.data.factory import buffer_kwargs, prompt_pool_kwargs
from laminar_jax.data.partial_pool import PartialPool
from laminar_jax.data.prompt_pool import PromptEncoder, PromptPool
from laminar_jax.data.records import (DroppedGroup, PartialTrajectory, PromptGroup, PromptRow, Trajectory,
                                      parse_request_id, request_id)
from laminar_jax.data.samplers import make_eviction, make_sampler
from laminar_jax.data.tasks import (TASKS, ArithmeticTask, CountdownTask, SftExample, SyntheticTask, get_task,
                                    sft_examples)

__all__ = [
    "TASKS", "ArithmeticTask", "BadRow", "BufferedGroup", "CharTokenizer", "CountdownTask", "DatasetError",
    "DroppedGroup", "ExperienceBuffer", "LoadedDataset", "PartialPool", "PartialTrajectory", "PromptEncoder",
    "PromptGroup", "PromptPool", "PromptRow", "SftExample", "SyntheticTask", "Trajectory", "buffer_kwargs",
    "get_task", "ledger_balance", "load_dataset", "load_prompt_file", "make_eviction", "make_sampler",
    "parse_request_id", "prompt_pool_kwargs", "request_id", "sft_examples",
]
