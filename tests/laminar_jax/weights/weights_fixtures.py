"""Shared by the relay tests: an emulated multi-node Ray cluster, one raylet (and object store)
per node on this machine, so transfers between relays are real."""
import time

import ray
from ray.cluster_utils import Cluster


def start_cluster(num_nodes: int, object_store_mb: int) -> Cluster:
    """`num_nodes` raylets of 2 logical CPUs; a Ray an earlier test module left connected is
    shut down first."""
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, object_store_memory=object_store_mb * 2**20, include_dashboard=False))
    for _ in range(num_nodes - 1):
        c.add_node(num_cpus=2, object_store_memory=object_store_mb * 2**20, wait=False)
    c.wait_for_nodes()
    ray.init(address=c.address)
    return c


def wait_for(pred, timeout_s: float = 90.0, what: str = "condition") -> None:
    """Polls `pred` until true; AssertionError naming `what` after `timeout_s`."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
