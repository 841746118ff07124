"""runtime.cluster.start: Ray's fixed node start-up wait, when it expires, is a ClusterError that
says why and what to do; any other ray.init failure passes through unchanged. The embedded
cluster's workers inherit the run's environment, so actors that need no other start without a
runtime env. Its head is lean: no API server, no autoscaler monitor, the log monitor kept."""
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


def test_the_embedded_clusters_workers_inherit_the_run_env_and_actors_that_need_no_other_get_no_runtime_env(
        monkeypatch, tmp_path):
    """`start` gives every worker of the embedded cluster the run's environment (it is in this
    process's environment only while Ray starts its raylet); an actor whose environment is that
    one is started without a runtime env (no runtime-env agent round trip before its process
    starts) and still sees it; any other actor gets a runtime env; so does every actor once that
    cluster is gone."""
    import os

    import ray
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster.reaper, "start", lambda: None)   # no watcher left behind in the test process
    keys = ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR")
    before = {k: os.environ.get(k) for k in keys}
    cache = str(tmp_path / "cache")
    import psutil
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}   # e.g. the package's test cluster
    try:
        assert cluster.start(load_config("configs/default.yaml", [f"run.compile_cache={cache}"]))
        assert {k: os.environ.get(k) for k in keys} == before, "the driver's own environment is put back"
        plain, wide = cluster.actor_options(None, 0.0), cluster.actor_options(None, 0.0, devices=2)
        assert "runtime_env" not in plain
        assert wide["runtime_env"]["env_vars"]["XLA_FLAGS"] == cluster.xla_flags(2)

        @ray.remote
        class Env:
            def get(self):
                return {k: os.environ.get(k) for k in keys}
        got = ray.get([Env.options(**opts).remote().get.remote() for opts in (plain, wide)], timeout=120)
        assert got[0] == {"XLA_FLAGS": cluster.xla_flags(1), "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": cache}
        assert got[1] == dict(got[0], XLA_FLAGS=cluster.xla_flags(2))
        # the lean head: Ray's API server and autoscaler monitor never started; the log monitor
        # (workers' output to the console) did
        scripts = {os.path.basename(arg) for p in psutil.Process().children(recursive=True) if p.pid not in earlier
                   for arg in p.cmdline() if arg.endswith(".py")}
        assert "log_monitor.py" in scripts and not scripts & {"dashboard.py", "monitor.py"}, scripts
    finally:
        ray.shutdown()
    assert cluster.runtime_env({"XLA_FLAGS": cluster.xla_flags(1)}) == {"env_vars": {"XLA_FLAGS": cluster.xla_flags(1)}}


def test_lean_head_stubs_its_skips_only_while_open_and_not_at_all_on_a_ray_without_them(monkeypatch):
    from ray._private.node import Node
    originals = {name: getattr(Node, name) for name in cluster.LEAN_HEAD_SKIPS}
    with cluster.lean_head() as stubbed:
        assert stubbed == list(cluster.LEAN_HEAD_SKIPS)
        assert all(getattr(Node, name) is not originals[name] for name in stubbed)
        assert Node.start_api_server(object(), include_dashboard=False, raise_on_failure=True) is None
    assert {name: getattr(Node, name) for name in cluster.LEAN_HEAD_SKIPS} == originals
    monkeypatch.delattr(Node, "start_monitor")     # a Ray version without one of them: its full head
    with cluster.lean_head() as stubbed:
        assert stubbed == [] and Node.start_api_server is originals["start_api_server"]
