"""The session cluster has two raylets (ray.cluster_utils.Cluster): one relay per node, rollouts
spread over both, each pulling from its own node's relay."""
from laminar_jax.analysis import load_run


def test_relay_per_node_and_local_pulls(three_step_run):
    """On the package's short run (conftest.three_step_run, shared with the notebook test)."""
    import ray
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    cfg, summary = three_step_run
    assert cfg.run.steps == 3
    run = load_run(summary["run_dir"])
    ev = run.events
    assert set(ev[ev.kind == "relay_started"].relay) == nodes
    pulls = ev[ev.kind == "pull"]
    assert set(pulls.node) == nodes, "rollouts on both nodes"
    assert (pulls.node == pulls.relay_node).all(), "each rollout pulled from its own node's relay"
    assert summary["accounting"]["unaccounted"] == 0
