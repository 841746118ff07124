import pytest

from tests.laminar_jax.runtime.runtime_fixtures import base_config, start_cluster, warm_up_result


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
def three_step_run(cluster, warm_model, tmp_path_factory):
    """One short real run, shared by the tests that only read a finished run folder (the suite's
    time is scarce): 3 steps of the arithmetic run on the two-node cluster, checkpointed by time
    only with a tiny interval (every step is due: run.checkpoint_every_s is read).
    Returns (cfg, driver summary); test_analysis_notebook and test_multinode assert on it."""
    from laminar_jax.runtime import driver
    cfg = base_config(str(tmp_path_factory.mktemp("three_steps")), "nb", warm_model, **{
        "run.steps": 3, "run.checkpoint_every": 0, "run.checkpoint_every_s": 0.001})
    return cfg, driver.run(cfg, quiet=True)
