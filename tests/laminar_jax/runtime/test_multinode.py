"""The session cluster has two raylets (ray.cluster_utils.Cluster): one relay per node, rollouts
spread over both, each pulling from its own node's relay."""
from laminar_jax.analysis import load_run


def test_relay_per_node_and_local_pulls(shared_run):
    """On the package's shared run (conftest.shared_run: test_modes_train's and the notebook's)."""
    import ray
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    cfg, summary = shared_run
    run = load_run(summary["run_dir"])
    ev = run.events
    assert set(ev[ev.kind == "relay_started"].relay) == nodes
    pulls = ev[ev.kind == "pull"]
    assert set(pulls.node) == nodes, "rollouts on both nodes"
    assert (pulls.node == pulls.relay_node).all(), "each rollout pulled from its own node's relay"
    assert summary["accounting"]["unaccounted"] == 0
