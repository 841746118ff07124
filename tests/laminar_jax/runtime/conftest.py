import pytest

from tests.laminar_jax.runtime.runtime_fixtures import SHARED_MODE, mode_config, start_cluster, warm_up_result


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


# Both warm-ups start in the background at the end of collection (tests/conftest.py): these
# wait for them.
@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    return warm_up_result("warm_model", str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="session")
def countdown_model(tmp_path_factory):
    return warm_up_result("countdown_model", str(tmp_path_factory.getbasetemp()))


# Package scope, as the cluster it runs on.
@pytest.fixture(scope="package")
def shared_run(cluster, countdown_model, tmp_path_factory):
    """test_modes_train's run of SHARED_MODE, shared by the tests that only read a finished run
    folder (the suite's time is scarce), checkpointed by time only with a tiny interval (every
    step is due: run.checkpoint_every_s is read). Returns (cfg, driver summary);
    test_modes_train, test_analysis_notebook and test_multinode assert on it."""
    from laminar_jax.runtime import driver
    cfg = mode_config(str(tmp_path_factory.mktemp("shared")), SHARED_MODE, countdown_model, **{
        "run.checkpoint_every": 0, "run.checkpoint_every_s": 0.001})
    return cfg, driver.run(cfg, quiet=True)
