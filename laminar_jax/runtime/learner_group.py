"""A learner over `learner.hosts` processes: placement, start-up and lockstep (learner/distributed.py).

    hosts = N     N `Learner` actors, one per placement-group bundle (SPREAD: one per node when
                  the cluster has the nodes; on one machine, N processes), each with its share of
                  the mesh's devices; process 0 is the leader, the others follow it.

JAX is multi-controller: every host must run every compiled step, in the same order, with the
same shapes. The driver talks to the leader only (the same handle and calls as one learner). The
leader has the data actor sample the global batch (`DataActor.wait_sample_hosts`: the actor keeps
each host's slice of the groups and hands the leader its own and a ticket) and, before each
collective piece of work (an update, a publish, a checkpoint save), hands the same call to every
follower (`Mirror.send`: an update carries the ticket, not the groups); a follower takes its own
slice from the data actor (`host_part`) and runs the calls in the leader's order (`Follower.run`,
by sequence number). Each host assembles only its rows (`runtime.host_batch` settles the shapes
and whole-batch numbers between them) and feeds them to the global arrays. The leader collects
the followers' results at the end of each step (their metrics, trajectory rows and stats), with a
timeout: a follower's error or death is a clear error naming the host, never a silent wait.

A host that dies inside a collective leaves the others blocked in it: the driver's liveness check
(`check_alive`, about once a second) names the dead host and stops the run; the next `laminar
train` of the run folder resumes from the last committed checkpoint (each host restores its shards,
onto any host count).
"""
from __future__ import annotations

import threading
from typing import Any

import ray

from laminar_jax.config_loader import ConfigError

PLACE_TIMEOUT_S = 120.0     # the learner bundles' reservation
FOLLOW_TIMEOUT_S = 900.0    # one mirrored call on a follower (a step: its compiles included)
ALIVE_TIMEOUT_S = 30.0      # one liveness ping of a learner host


class LearnerHostError(RuntimeError):
    """A learner host died or failed; the run stops (and resumes from its last checkpoint)."""


def mesh_devices(cfg: Any) -> int:
    """The learner mesh's devices over all hosts (mesh.data=-1 counting as 1, as the fleet does)."""
    m = cfg.mesh
    return max(1, m.data) * m.fsdp * m.tensor


def devices_per_host(cfg: Any) -> int:
    """Learner devices each host contributes: the mesh's devices (data=-1 counting as 1, as the
    fleet does) split evenly over `learner.hosts`; a mesh that does not divide is a ConfigError
    naming mesh.* and learner.hosts."""
    from laminar_jax.learner.distributed import check_mesh
    m, hosts = cfg.mesh, cfg.learner.hosts
    total = mesh_devices(cfg)
    if total % hosts:
        raise ConfigError(f"mesh.data={m.data} x mesh.fsdp={m.fsdp} x mesh.tensor={m.tensor} = {total} learner "
                          f"devices do not split evenly over learner.hosts={hosts}")
    local = total // hosts
    try:
        check_mesh(m, hosts=hosts, local_devices=local)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return local


def check_batch(cfg: Any) -> None:
    """Each host takes whole groups of every mini-batch (its slice of the batch): a ConfigError
    naming learner.global_batch_groups, learner.mini_batches and learner.hosts otherwise."""
    lc = cfg.learner
    if lc.global_batch_groups % (lc.hosts * lc.mini_batches):
        raise ConfigError(f"learner.global_batch_groups={lc.global_batch_groups} does not split into "
                          f"learner.mini_batches={lc.mini_batches} x learner.hosts={lc.hosts} equal parts of "
                          f"whole groups")


def bundles(cfg: Any, kind: str | None) -> list[dict]:
    """One placement-group bundle per learner host: its accelerators, or on CPU one logical CPU
    (actors otherwise take 0, so this only bounds how many learner hosts a node takes)."""
    local = devices_per_host(cfg)
    return [{kind: float(local)} if kind else {"CPU": 1.0} for _ in range(cfg.learner.hosts)]


def check(cfg: Any, kind: str | None) -> None:
    """Before any worker starts: the mesh divides over the hosts, the cluster can place one
    bundle per host (each bundle on one node; ClusterError otherwise) and the batch splits into
    whole groups per host (`check_batch`)."""
    from laminar_jax.runtime.cluster import ClusterError
    hosts = cfg.learner.hosts
    if hosts == 1:
        return
    want = bundles(cfg, kind)[0]
    (res, amount), = want.items()
    fits = sum(int(n["Resources"].get(res, 0.0) // amount) for n in ray.nodes() if n.get("Alive"))
    if fits < hosts:
        raise ClusterError(f"learner.hosts={hosts}: each learner host needs {amount:g} {res} on one node, and the "
                           f"Ray cluster can place only {fits} such hosts; lower learner.hosts or add nodes")
    check_batch(cfg)


def _pick_port(host: str) -> str:
    """`host:port` free on the node this runs on (a task in bundle 0; no jax import here)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def start(cfg: Any, learner_cls: Any, args: tuple, kwargs: dict, *, kind: str | None, env: dict,
          name: str) -> tuple[Any, list[Any], Any]:
    """Places and creates the `learner.hosts` learner actors; returns (leader, every host, the
    placement group). The coordinator is chosen here, on loopback of bundle 0's node when every
    bundle is on the driver's machine (else on that node's address)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from laminar_jax.runtime import cluster

    hosts, local = cfg.learner.hosts, devices_per_host(cfg)
    pg = placement_group(bundles(cfg, kind), strategy="SPREAD", name=name)
    try:
        ray.get(pg.ready(), timeout=PLACE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise cluster.ClusterError(f"learner.hosts={hosts}: the cluster did not place {hosts} learner bundles "
                                   f"within {PLACE_TIMEOUT_S:.0f} s") from None
    at = lambda i: PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)  # noqa: E731
    here = ray.util.get_node_ip_address()
    from ray.util.placement_group import placement_group_table
    node_of = placement_group_table(pg)["bundles_to_node_id"]
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    same_machine = all(ips.get(node_of[i]) == here for i in range(hosts))
    host = cluster.LOOPBACK if same_machine else ips[node_of[0]]
    coordinator = ray.get(ray.remote(num_cpus=0)(_pick_port).options(scheduling_strategy=at(0)).remote(host),
                          timeout=60)
    def create(i: int, followers: list | None) -> Any:
        # threads: mirrored calls wait their turn on one each, and liveness pings need one free
        opts = cluster.actor_options(kind, local if kind else 0.0, devices=local, max_concurrency=16, env=env)
        opts["scheduling_strategy"] = at(i)
        return ray.remote(learner_cls).options(**opts).remote(
            *args, **dict(kwargs, host=(i, hosts, coordinator), followers=followers))
    followers = [create(i, None) for i in range(1, hosts)]
    handles = [create(0, followers), *followers]   # the leader holds every follower's handle
    return handles[0], handles, pg


def check_alive(handles: list[Any], timeout_s: float = ALIVE_TIMEOUT_S, *, first: int = 0) -> None:
    """LearnerHostError naming the first learner host that is dead (`handles` are hosts first,
    first + 1, ...). A host that only answers late (busy, a loaded machine) is not dead: the
    step's own timeout covers a hung one."""
    refs = [h.pid.remote() for h in handles]
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            continue
        except ray.exceptions.RayActorError as e:
            raise LearnerHostError(
                f"learner host {first + i} of learner.hosts={first + len(handles)} is dead ({type(e).__name__}); the run "
                f"stops here -- rerun `laminar train` on the run folder to resume from its last checkpoint") from None


class Mirror:
    """Leader side: sends each collective call to every follower, in order; `collect` waits for
    them (with a timeout) and turns a follower's failure into a LearnerHostError."""

    def __init__(self, followers: list[Any] | None):
        self.followers = list(followers or [])
        self._seq, self._pending = 0, []

    def send(self, version: int, op: str, *args: Any) -> None:
        if not self.followers:
            return
        payload = ray.put(args)   # one copy of the groups in the object store for every host
        for f in self.followers:
            self._pending.append(f.follow.remote(self._seq, version, op, payload))
        self._seq += 1

    def alive(self, timeout_s: float = 10.0) -> bool:
        """Whether every follower is alive (a dead one means no collective can finish)."""
        try:
            check_alive(self.followers, timeout_s=timeout_s, first=1)
            return True
        except LearnerHostError:
            return False

    def explain(self, error: BaseException) -> None:
        """After a failed collective (gloo: "connection reset by peer" when a host died):
        LearnerHostError naming the dead host, from `error`; nothing when every host lives."""
        if self.followers:
            try:
                check_alive(self.followers, timeout_s=10.0, first=1)
            except LearnerHostError as e:
                raise e from error

    def collect(self, timeout_s: float = FOLLOW_TIMEOUT_S) -> list[Any]:
        """The followers' results of the calls sent since the last collect, in sending order."""
        pending, self._pending, results = self._pending, [], []
        for ref in pending:
            try:
                results.append(ray.get(ref, timeout=timeout_s))
            except ray.exceptions.GetTimeoutError:
                raise LearnerHostError(f"a learner host did not finish its part of the step within "
                                       f"{timeout_s:.0f} s") from None
            except ray.exceptions.RayActorError as e:
                raise LearnerHostError(f"a learner host died during the step: {e}") from None
        return results


class Follower:
    """Follower side: runs the leader's calls strictly in the order it sent them."""

    def __init__(self, timeout_s: float = FOLLOW_TIMEOUT_S):
        self._next, self._cond, self.timeout_s = 0, threading.Condition(), timeout_s

    def run(self, seq: int, fn: Any) -> Any:
        with self._cond:
            if not self._cond.wait_for(lambda: self._next == seq, timeout=self.timeout_s):
                raise LearnerHostError(f"follower: call {seq} waited {self.timeout_s:.0f} s for call {self._next}")
        try:
            return fn()
        finally:
            with self._cond:
                self._next += 1
                self._cond.notify_all()
