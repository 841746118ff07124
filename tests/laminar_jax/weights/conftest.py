import pytest
import ray

from tests.laminar_jax.weights.weights_fixtures import start_cluster

NUM_NODES, OBJECT_STORE_MB = 4, 200


# Package scope: the relay modules (test_relay_cluster, test_relay_transports) share one
# emulated 4-node cluster instead of starting one each (the suite's time is scarce). Each
# module's relay groups use prefixes of their own and shut down with the module.
@pytest.fixture(scope="package")
def relay_cluster():
    c = start_cluster(NUM_NODES, object_store_mb=OBJECT_STORE_MB)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
