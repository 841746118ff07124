"""runtime.cluster.start: Ray's fixed node start-up wait, when it expires, is a ClusterError that
says why and what to do; any other ray.init failure passes through unchanged."""
from __future__ import annotations

import pytest

from laminar_jax.config import load_config
from laminar_jax.runtime import cluster

# Ray 2.60's own message (ray/_private/node.py) when its raylet does not register within 30 s.
# An overloaded machine cannot be made on demand, so ray.init is a stand-in that raises it.
RAY_NODE_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet "
                    "failed to startup or the GCS has become overloaded.")


@pytest.mark.parametrize("message, expected", [(RAY_NODE_TIMEOUT, cluster.ClusterError), ("other", RuntimeError)])
def test_a_node_start_timeout_is_a_cluster_error_naming_the_way_out(monkeypatch, message, expected):
    def init(**kwargs):            # stand-in for ray.init on a machine too loaded to start a node
        raise (Exception if expected is cluster.ClusterError else RuntimeError)(message)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "init", init)
    monkeypatch.setattr(cluster.reaper, "start", lambda: None)
    with pytest.raises(expected) as err:
        cluster.start(load_config("configs/default.yaml"))
    if expected is cluster.ClusterError:
        text = str(err.value)
        assert "fixed 30 s" in text and "load average" in text and "run.ray_address" in text
    else:
        assert str(err.value) == "other"
