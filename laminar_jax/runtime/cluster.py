"""Ray for a run: an embedded local cluster on loopback, or an existing one (RAY_ADDRESS).

Embedded: token auth off (`RAY_AUTH_MODE=disabled`), every server on 127.0.0.1, no dashboard,
and logical CPUs: actors ask for 0 or fractional CPUs, so a 2-core machine runs learner, rollouts,
relays and data actors at once (environment.md, Ray pitfalls 5-8). An already initialised Ray (a
test session) is reused.

Loopback, and why it takes two settings: Ray 2.60 binds GCS, raylet, object manager, workers and
agents to the node IP, and takes the node IP from `services.get_node_ip_address`, which answers
127.0.0.1 only when `ray_constants.ENABLE_RAY_CLUSTER` is false. That constant is read from
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` when `ray` is imported -- before this module runs -- so the
environment variable alone reaches only the processes Ray starts (raylet, agents, workers); this
process's copy of the constant is set too. `_node_ip_address="127.0.0.1"` then resolves to
loopback (Ray maps a loopback address to `get_node_ip_address()`).

Joining a cluster (`RAY_ADDRESS` / `run.ray_address`): a "host:port" that nothing answers is a
`ClusterError` within CONNECT_TIMEOUT_S (Ray itself retries for minutes).
"""
from __future__ import annotations

import os
import socket
from typing import Any

import ray
from ray._private import ray_constants

LOGICAL_CPUS = 16
LOOPBACK = "127.0.0.1"
CONNECT_TIMEOUT_S = 5.0


class ClusterError(ValueError):
    """The cluster cannot host what the config asks for."""


def start(cfg: Any) -> bool:
    """Connects to or starts Ray; True when this call started it (so the run shuts it down)."""
    if ray.is_initialized():
        return False
    env_address = os.environ.get("RAY_ADDRESS")
    address = env_address or cfg.run.ray_address
    if address:
        check_reachable(address, key="RAY_ADDRESS" if env_address else "run.ray_address")
        ray.init(address=address, log_to_driver=True)
        return True
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"   # the processes Ray starts
    ray_constants.ENABLE_RAY_CLUSTER = False                # this one (module docstring)
    ray.init(address="local", num_cpus=LOGICAL_CPUS, include_dashboard=False, log_to_driver=True,
             _node_ip_address=LOOPBACK,
             runtime_env={"env_vars": {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}})
    return True


def check_reachable(address: str, *, key: str = "run.ray_address",
                    timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """ClusterError unless a TCP connect to a "host:port" address succeeds within timeout_s.
    "auto" and "ray://" (Ray's own lookup / client) are left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(f"{key}={address!r}: expected 'host:port', 'auto' or 'ray://host:port'")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ClusterError(f"{key}={address!r}: no Ray cluster answers there ({e}); start it "
                           f"(`ray start --head`) or unset {key} to run an embedded one") from None


def accelerator_kind() -> str | None:
    res = ray.cluster_resources()
    return "GPU" if res.get("GPU", 0) > 0 else ("TPU" if res.get("TPU", 0) > 0 else None)


def check_resources(cfg: Any, learner_devices: int) -> dict[str, float]:
    """Accelerators each rollout and the learner ask for; ClusterError when the cluster lacks them."""
    kind = accelerator_kind()
    per_rollout = cfg.rollout.accelerators_per_rollout
    want = per_rollout * cfg.rollout.num_rollouts + (learner_devices if kind else 0)
    have = ray.cluster_resources().get(kind or "GPU", 0.0)
    if per_rollout > 0 and want > have:
        raise ClusterError(
            f"rollout.accelerators_per_rollout={per_rollout} x rollout.num_rollouts={cfg.rollout.num_rollouts}"
            f"{f' + learner {learner_devices}' if kind else ''} = {want} {kind or 'GPU'}s, but the Ray cluster "
            f"has {have}; lower the config or add nodes")
    return {"rollout": per_rollout, "learner": float(learner_devices) if kind else 0.0}


def actor_options(kind: str | None, accelerators: float, *, devices: int = 1, node: str | None = None,
                  max_concurrency: int = 8) -> dict:
    """Ray options: logical 0 CPUs, the accelerators asked for, and on CPU `devices` fake JAX
    devices (XLA_FLAGS in the runtime env), pinned to `node` when given."""
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    if kind is None:
        env["JAX_PLATFORMS"] = "cpu"
    opts: dict[str, Any] = dict(num_cpus=0, max_concurrency=max_concurrency, runtime_env={"env_vars": env})
    if accelerators and kind:
        opts["num_gpus" if kind == "GPU" else "resources"] = accelerators if kind == "GPU" else {kind: accelerators}
    if node is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    return opts


def alive_nodes() -> list[str]:
    """Alive node ids, the caller's node first."""
    here = ray.get_runtime_context().get_node_id()
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    return [here] + [n for n in nodes if n != here]
