"""The engine contract (`engine_contract.py`) on the JAX engine."""
import pytest

from rollout.jax_engine import JaxEngine
from tests.rollout.engine_contract import *  # noqa: F401,F403  (the shared tests)
from tests.rollout.engine_contract import MAX_LEN
from tests.rollout.rollout_fixtures import JAX_ENGINE_KW


@pytest.fixture(scope="module")
def engine(checkpoint_dirs):
    eng = JaxEngine.from_pretrained(checkpoint_dirs[0], **dict(JAX_ENGINE_KW, max_model_len=MAX_LEN))
    eng.kind = "jax"
    yield eng
    assert not eng.has_unfinished(), "a test left requests in the engine"
