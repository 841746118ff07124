"""Session fixtures of the engine tests: two tiny Qwen2 checkpoints and their references."""
import pytest

from tests.rollout.rollout_fixtures import Reference, make_checkpoint


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory):
    """(folder of weights A, folder of weights B): same shapes, different random weights."""
    return (make_checkpoint(str(tmp_path_factory.mktemp("ckpt_a")), seed=0),
            make_checkpoint(str(tmp_path_factory.mktemp("ckpt_b")), seed=1))


@pytest.fixture(scope="session")
def references(checkpoint_dirs):
    return tuple(Reference(folder) for folder in checkpoint_dirs)
