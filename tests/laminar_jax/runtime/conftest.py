import pytest

from tests.laminar_jax.runtime.runtime_fixtures import start_cluster, warm_up_model


@pytest.fixture(scope="session")
def cluster():
    import ray
    c = start_cluster()
    yield c
    if c is not None:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    return warm_up_model(str(tmp_path_factory.mktemp("warm")))
