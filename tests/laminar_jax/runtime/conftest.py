import pytest

from tests.laminar_jax.runtime.runtime_fixtures import countdown_warm_up, start_cluster, warm_up_model


# Package scope: the cluster goes down when the runtime tests are done, so later test modules
# (the relay tests) can start clusters of their own.
@pytest.fixture(scope="package")
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


@pytest.fixture(scope="session")
def countdown_model(tmp_path_factory):
    return countdown_warm_up(str(tmp_path_factory.mktemp("warm_countdown")))
