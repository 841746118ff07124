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

Lean head: the embedded node starts without the API server (`dashboard.py`, which with
`include_dashboard=False` serves only usage stats, and which `ray.init` polls for 1 s before
starting the raylet) and without the autoscaler monitor (`monitor.py`: nothing to scale on one
machine). `ray.init` has no switch for either, so `lean_head` stubs Ray's private
`Node.start_api_server` / `Node.start_monitor` while the node starts (skipped, with Ray's full
head, where a Ray version lacks them). The log monitor stays: it carries the workers' output to
the console. Measured on this 2-core machine: `ray.init` 2.4-3.3 -> 1.5 s, Ray's own start-up
CPU 3.5 -> 2.8 s. Job submission and the state API (`ray list`) need the API server: point
`run.ray_address` at a `ray start --head` cluster for them.

Joining a cluster (`RAY_ADDRESS` / `run.ray_address`): a "host:port" that nothing answers is a
`ClusterError` within CONNECT_TIMEOUT_S (Ray itself retries for minutes).
"""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Iterator

import ray
from ray._private import ray_constants

from laminar_jax.config_loader import ConfigError
from laminar_jax.runtime import compile_cache, reaper

LOGICAL_CPUS = 16
LOOPBACK = "127.0.0.1"
CONNECT_TIMEOUT_S = 5.0
# Ray's raylet prestarts idle Python workers for the first driver; every actor of a run asks for
# its own runtime env (XLA_FLAGS), so none of them took one: on 2 cores that was ~1 CPU s each
# for nothing during start-up (measured: 2 `ray::IDLE` workers still idle at the first step)
NO_PRESTART = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
# (node id, environment) of the embedded cluster `start` made: its workers inherit that
# environment, so an actor that needs no other starts without a runtime env (`runtime_env`). A
# node id, not the GCS address: a later cluster in this process (a test's) may reuse the port
_inherited: tuple[str, dict] | None = None


class ClusterError(ConfigError):
    """The cluster cannot host what the config asks for."""


# the head's processes an embedded run does without (module docstring, "Lean head")
LEAN_HEAD_SKIPS = ("start_api_server", "start_monitor")


@contextlib.contextmanager
def lean_head() -> Iterator[list[str]]:
    """While it is open, a Ray head node started in this process skips LEAN_HEAD_SKIPS; yields
    the names it stubbed (none where this Ray version lacks them)."""
    from ray._private.node import Node
    saved = {name: getattr(Node, name) for name in LEAN_HEAD_SKIPS if callable(getattr(Node, name, None))}
    if len(saved) < len(LEAN_HEAD_SKIPS):   # another Ray: start its full head rather than half of one
        saved = {}
    for name in saved:
        setattr(Node, name, lambda self, *a, **kw: None)
    try:
        yield list(saved)
    finally:
        for name, fn in saved.items():
            setattr(Node, name, fn)


def start(cfg: Any) -> bool:
    """Connects to or starts Ray; True when this call started it (so the run shuts it down)."""
    if ray.is_initialized():
        return False
    env_address = os.environ.get("RAY_ADDRESS")
    address = env_address or cfg.run.ray_address
    if address:
        check_reachable(address, key="RAY_ADDRESS" if env_address else "run.ray_address")
        ray.init(address=address, log_to_driver=True,
                 runtime_env={"env_vars": compile_cache.env(cfg.run.compile_cache)})
        return True
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"   # the processes Ray starts
    ray_constants.ENABLE_RAY_CLUSTER = False                # this one (module docstring)
    reaper.start()   # a SIGKILL of this process leaves no Ray process behind (runtime.reaper)
    # what every worker inherits: set in this process's environment while Ray starts its raylet
    # (whose workers inherit it), then put back (`runtime_env`: actors with this environment
    # start without a runtime env)
    base = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "XLA_FLAGS": xla_flags(1),
            **compile_cache.env(cfg.run.compile_cache)}
    saved = {k: os.environ.get(k) for k in base}
    os.environ.update(base)
    try:
        with lean_head():
            ray.init(address="local", num_cpus=LOGICAL_CPUS, include_dashboard=False, log_to_driver=True,
                     _node_ip_address=LOOPBACK, _system_config=NO_PRESTART)
    except Exception as e:
        # Ray 2.60 waits a fixed 30 s for its raylet to register (ray/_private/node.py, a local
        # constant: RAY_raylet_start_wait_time_s, which its message names, does not reach it);
        # on an overloaded machine that is the failure, so say so and what to do
        if "timed out during startup" not in str(e):
            raise
        load = os.getloadavg()[0]
        raise ClusterError(f"the embedded Ray node did not start within Ray's fixed 30 s (load average {load:.0f} "
                           f"on {os.cpu_count()} cores); retry when the machine is less loaded, or start one "
                           f"first (`ray start --head`) and point run.ray_address / RAY_ADDRESS at it") from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    global _inherited
    _inherited = (ray.get_runtime_context().get_node_id(), base)
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


def check_resources(cfg: Any, learner_devices: int) -> dict[str, Any]:
    """Accelerators the learner and each rollout ask for; ClusterError, before any actor starts,
    when the cluster lacks them. Returns {"learner": n, "rollout": {rollout id: n}}.

    Pool by pool (`rollout.pools`, or the short form as one pool), in order: each pool's total
    must fit in what the learner and the earlier pools leave, and a rollout asking for more than
    one accelerator must fit on one node (its placement group is one bundle)."""
    kind = accelerator_kind()
    res = ray.cluster_resources()
    have = res.get(kind or "GPU", 0.0)
    frac = cfg.learner.memory_fraction  # one learner device: its memory share is its GPU share too
    learner = (frac if frac is not None and learner_devices == 1 else float(learner_devices)) if kind else 0.0
    per_node = max((n["Resources"].get(kind or "GPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=0.0)
    used = learner
    short = not cfg.rollout.pools
    for i, pool in enumerate(cfg.rollout.pools_resolved()):
        key = "rollout" if short else f"rollout.pools[{i}]"
        a = pool.accelerators_per_rollout
        want = a * pool.num_rollouts
        name = "" if short else f" (pool {pool.name!r}, engine {pool.engine})"
        if a > 0 and used + want > have:
            raise ClusterError(
                f"{key}{name}: {pool.num_rollouts} rollouts x {key}.accelerators_per_rollout={a} = {want:g} "
                f"{kind or 'GPU'}s, but the Ray cluster has {have:g}{f' ({used:g} taken by the learner and earlier pools)' if used else ''}; "
                f"lower the config or add nodes")
        if a > 1 and a > per_node:
            raise ClusterError(f"{key}{name}: {key}.accelerators_per_rollout={a} {kind or 'GPU'}s for one rollout, "
                               f"but no node has more than {per_node:g}")
        used += want
    return {"learner": learner, "rollout": rollout_accelerators(cfg)}


def rollout_accelerators(cfg: Any) -> dict[str, float]:
    """Accelerators each rollout asks for, by rollout id (its pool's accelerators_per_rollout)."""
    return {rid: pool.accelerators_per_rollout for rid, pool in cfg.rollout.assignments()}


def placement_group_for(kind: str, accelerators: float, name: str, timeout_s: float = 120.0):
    """A one-bundle placement group holding a multi-accelerator rollout's devices on one node
    (vLLM's tensor-parallel workers run inside the rollout's actor); ClusterError on timeout."""
    from ray.util.placement_group import placement_group

    bundle = {"GPU": accelerators} if kind == "GPU" else {kind: accelerators}
    pg = placement_group([bundle], strategy="STRICT_PACK", name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group
        remove_placement_group(pg)
        raise ClusterError(f"{name}: no node could reserve {accelerators:g} {kind}s within {timeout_s:.0f} s") from None
    return pg


def xla_flags(devices: int) -> str:
    """The XLA_FLAGS of a process of the run (an actor, the warm-up): `devices` host devices."""
    return f"--xla_force_host_platform_device_count={devices}"


def runtime_env(env_vars: dict) -> dict | None:
    """The runtime env of an actor with these environment variables, or None where the workers
    of the embedded cluster (`start`, this process's) already have them all. Without a runtime
    env the raylet starts the actor's process without asking its runtime-env agent first:
    measured with five trivial actors on 2 cores (Ray starts workers two at a time), all up 2.2-2.3
    s after creation instead of 3.6-3.8 s, the first pair 0.8 s instead of 1.3-1.4 s."""
    if (_inherited is not None and ray.is_initialized() and ray.get_runtime_context().get_node_id() == _inherited[0]
            and all(_inherited[1].get(k) == v for k, v in env_vars.items())):
        return None
    return {"env_vars": dict(env_vars)}


def actor_options(kind: str | None, accelerators: float, *, devices: int = 1, node: str | None = None,
                  max_concurrency: int = 8, placement_group: Any = None, env: dict | None = None) -> dict:
    """Ray options: logical 0 CPUs, the accelerators asked for, and on CPU `devices` fake JAX
    devices (XLA_FLAGS in the runtime env, unless the workers inherit it: `runtime_env`), pinned
    to `node` when given, or scheduled in bundle 0 of `placement_group`. `env`: more environment
    variables of the actor."""
    env = {"XLA_FLAGS": xla_flags(devices), **(env or {})}
    if kind is None:
        env["JAX_PLATFORMS"] = "cpu"
    opts: dict[str, Any] = dict(num_cpus=0, max_concurrency=max_concurrency)
    if (renv := runtime_env(env)) is not None:
        opts["runtime_env"] = renv
    if accelerators and kind:
        opts["num_gpus" if kind == "GPU" else "resources"] = accelerators if kind == "GPU" else {kind: accelerators}
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=0)
    elif node is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    return opts


def alive_nodes() -> list[str]:
    """Alive node ids, the caller's node first."""
    here = ray.get_runtime_context().get_node_id()
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    return [here] + [n for n in nodes if n != here]
