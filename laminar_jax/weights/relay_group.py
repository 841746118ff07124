"""The relay tier: one RelayWorker per node, wired into a chain, repaired on failure (Laminar §4.3).

    group = RelayGroup(cfg, store, publisher=publisher, events=log)   # one relay per alive node
    relay = group.relay_for(node_id)        # or, inside a rollout actor: local_relay()
    group.check()                           # heartbeat round: evict dead relays, re-link
    group.collect_events()                  # relay events into the group's event sink

Placement: each relay is pinned to its node (hard node affinity) and named
`{prefix}:{node_id}`, so a rollout worker finds the relay on its own node. The chain is
`chain.chain_order(nodes, master_node)`; the master sits where it can read the weight store (the
learner's node by default). `topology="fanout"` wires the master straight to every relay instead
(the naive baseline of the benchmark). `transport="tcp"` (default) moves chunk bytes over direct
relay-to-relay TCP streams (`weights.stream`); `"object_store"` moves them as Ray objects. With
`shared_memory` (default) each relay keeps its versions in shared memory (`weights.shared_buffer`):
its rollouts map the served version read-only, and a downstream relay on the same host copies each
chunk from the upstream's buffer rather than reading it from a socket. Control (wiring, resend
requests, pulls) always goes through Ray.

Faults: a relay that stops answering with an actor error is evicted and `chain.relink` cuts it
out; its upstream is re-pointed at its downstream and resends the chunks the downstream lacks. If
the master died, the next relay of the chain becomes master and the publisher (and every
`on_master_change` callback) is told, so the newest published version is announced to it again.
That relay is warm: the next master in line follows the weight store as a standby
(`RelayWorker.prepare_standby`, `weights.standby`), preparing each committed version it lacks
(one named at a failover starts after the new master's first broadcast), so a promotion
serves the newest version without an orbax restore, and a failover costs about a normal
broadcast, not a process's first orbax restore. A dead relay whose node is still alive is
started again (up to `max_restarts` per group) and appended to the chain; its upstream resends it the current
version. The start does not block the group (the heartbeat moves it on), and after a master
failover it waits for the new master's first broadcast and RESTART_SETTLE_S more while the rollouts
load it (RESTART_DEFER_S at most): a relay process starting takes the cores they need.
Meanwhile the rollouts of that node read another node's relay, or the weight store
(`weights.source.RelaySource`), so a relay's death never costs a rollout.
`start_monitor(interval_s)` runs `check` on a thread, so a master's death is repaired within about
interval_s, not at the driver's next relay check. Every control call has a timeout (CALL_TIMEOUT_S).

Addresses: relay streams listen on 127.0.0.1 when every node of the group has one IP (one host,
e.g. the embedded cluster or an emulated multi-node one), on the node IP only across hosts.
"""
from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from typing import Any, Callable, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from laminar_jax.weights import chain
from laminar_jax.weights.master import MasterRole
from laminar_jax.weights.relay import TRANSPORTS, RelayWorker

__all__ = ["RelayGroup", "local_relay", "DEFAULT_PREFIX"]

DEFAULT_PREFIX = "laminar-relay"
# Default chunk-size cap per transport. A stream chunk costs a 48-byte header, so small chunks are
# cheap and let a relay check chunk k while it reads chunk k+1; an object-store chunk costs a put,
# an actor call and a pull (~2 ms), so chunks there stay large.
MAX_CHUNK_BYTES = {"tcp": 16 * 2**20, "object_store": 64 * 2**20}
CALL_TIMEOUT_S = 300.0   # generous: a relay process starting on a loaded machine takes a minute
# after a master failover, relay restarts wait for the new master's first broadcast, this long at most
RESTART_DEFER_S = 10.0
# ... and then this much longer, while the rollouts load that broadcast
RESTART_SETTLE_S = 1.5
MASTER_POLL_S = 5.0     # the heartbeat's question to the master about its served version
STOP_TIMEOUT_S = 30.0   # RelayWorker.stop: the longest a relay's restore in flight may take to end
WATCH_S = 30.0          # length of one relay `watch` call of the monitor (re-armed when it returns)
LOOPBACK = "127.0.0.1"


@dataclasses.dataclass
class _Restart:
    due: float                 # monotonic time the relay process may start
    after: int | None          # ... or once the master serves a version newer than this
    handle: Any = None
    ping: Any = None
    started: float = 0.0


def _locked(method: Callable) -> Callable:
    """Runs the method under the group's lock (the monitor thread changes the chain too)."""
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
    return wrapper


def stream_host(nodes: Sequence[str]) -> str | None:
    """127.0.0.1 when every node in `nodes` has one IP (one host), else None (each relay's node IP)."""
    ips = {n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] in set(nodes)}
    return LOOPBACK if len(ips) <= 1 else None


def _alive_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def local_relay(prefix: str = DEFAULT_PREFIX, namespace: str | None = None) -> Any:
    """The relay on the caller's node (for a rollout worker)."""
    node = ray.get_runtime_context().get_node_id()
    return ray.get_actor(f"{prefix}:{node}", namespace=namespace)


class RelayGroup:
    """Creates and supervises the relays.

    Args:
      cfg: the model's DecoderConfig (the master converts checkpoints with it).
      store: the publisher's WeightStore.
      nodes: node ids to place relays on (default: every alive Ray node), in chain order.
      master_node: where the master goes (default: the store's node, else the caller's node).
      topology: "chain" (pipelined chain, the paper's) or "fanout" (master sends to everyone).
      num_chunks: fix k; None lets the master pick `chain.optimal_chunks` for each version.
      t_byte, t_start, max_chunks, max_chunk_bytes: how the master picks k (`MasterRole`);
        max_chunk_bytes None takes `MAX_CHUNK_BYTES[transport]`.
      publisher: a `publish.Publisher` to point at the master now and after every failover.
      on_master_change: more callbacks `(master_handle) -> None` (e.g. a remote learner's).
      events: `(kind, **fields)` sink; `EventLog.add` is used for relay records when present.
      prefix, namespace: actor names `{prefix}:{node_id}`.
      runtime_env: extra runtime_env for relay processes (JAX_PLATFORMS=cpu is always set, so a
        relay never takes an accelerator); None: that alone. inherit_env: no runtime env at all,
        the caller's word that the workers already have JAX_PLATFORMS=cpu and what runtime_env
        would add (`runtime.cluster.runtime_env`: the process then starts sooner).
      transport: "tcp" or "object_store": how chunk bytes move between relays.
      fetch_timeout_s, prefetch, stream_timeout_s, shared_memory, shared_links: per-relay
        settings (see RelayWorker).
    """

    def __init__(self, cfg: Any, store: Any, *, nodes: Sequence[str] | None = None,
                 master_node: str | None = None, topology: str = "chain",
                 num_chunks: int | None = None, t_byte: float = 1e-9, t_start: float = 2e-3,
                 max_chunks: int = 256, max_chunk_bytes: int | None = None, publisher: Any = None,
                 on_master_change: Sequence[Callable[[Any], None]] = (),
                 events: Callable[..., None] | None = None, prefix: str = DEFAULT_PREFIX,
                 namespace: str | None = None, runtime_env: dict | None = None, inherit_env: bool = False,
                 transport: str = "tcp", fetch_timeout_s: float = 120.0, prefetch: int = 2,
                 stream_timeout_s: float = 60.0, shared_memory: bool = True,
                 shared_links: bool = True, idle_timeout_s: float = 300.0,
                 max_connections: int = 64, max_restarts: int = 3):
        if topology not in ("chain", "fanout"):
            raise ValueError(f"RelayGroup: topology must be 'chain' or 'fanout', got {topology!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"RelayGroup: transport must be one of {TRANSPORTS}, got {transport!r}")
        if not stream_timeout_s > 0:
            raise ValueError(f"RelayGroup: stream_timeout_s must be > 0, got {stream_timeout_s!r}")
        nodes = list(nodes) if nodes is not None else _alive_nodes()
        if not nodes:
            raise ValueError("RelayGroup: no nodes to place relays on")
        if master_node is None:
            here = ray.get_runtime_context().get_node_id()
            master_node = store.node_id if store.node_id in nodes else here
        self.cfg, self.store, self.topology = cfg, store, topology
        if max_chunk_bytes is None:
            max_chunk_bytes = MAX_CHUNK_BYTES[transport]
        self._role_args = dict(num_chunks=num_chunks, t_byte=t_byte, t_start=t_start,
                               max_chunks=max_chunks, max_chunk_bytes=max_chunk_bytes)
        self._publisher = publisher
        self._callbacks = list(on_master_change)
        self._events = events or (lambda kind, **fields: None)
        self.prefix, self.namespace = prefix, namespace
        self._actor_options = dict(num_cpus=0, max_concurrency=64, namespace=namespace, max_restarts=0)
        if not inherit_env:
            env = dict(runtime_env or {})
            env["env_vars"] = {"JAX_PLATFORMS": "cpu", **env.get("env_vars", {})}
            self._actor_options["runtime_env"] = env
        self.transport = transport
        self.stream_token = secrets.token_hex(16)   # relays of this group accept only each other
        self._worker_args = dict(transport=transport, fetch_timeout_s=fetch_timeout_s,
                                 prefetch=prefetch, stream_timeout_s=stream_timeout_s,
                                 stream_token=self.stream_token, shared_memory=shared_memory,
                                 shared_links=shared_links, idle_timeout_s=idle_timeout_s,
                                 max_connections=max_connections, host=stream_host(nodes))
        self.max_restarts, self.restarts = max_restarts, 0
        self.checks = 0                     # heartbeat rounds run (the monitor's cadence)
        self._lock = threading.RLock()      # check() on the monitor thread vs. the caller's calls
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()
        self.order: tuple[str, ...] = chain.chain_order(nodes, master_node)
        self._pending: dict[str, _Restart] = {}   # dead relays being started again
        self._standby: str | None = None    # the warmed next master in line
        self.relays: dict[str, Any] = {node: self._start(node) for node in self.order}
        placed = ray.get([r.node_id.remote() for r in self.relays.values()], timeout=CALL_TIMEOUT_S)
        for node, actual in zip(self.relays, placed):
            if node != actual:
                raise RuntimeError(f"RelayGroup: relay for node {node} started on {actual}")
            self._events("relay_started", relay=node)
        self._wire(self.order)
        self._make_master()

    # ------------------------------------------------------------------ placement and wiring
    def _start(self, node: str) -> Any:
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        actor = ray.remote(RelayWorker).options(name=f"{self.prefix}:{node}",
                                                scheduling_strategy=strategy,
                                                **self._actor_options)
        return actor.remote(node, **self._worker_args)

    def _chain_length(self) -> int:
        # k is chosen for the pipeline depth; a fan-out has one hop per relay.
        return len(self.order) if self.topology == "chain" else min(2, len(self.order))

    def _configure_master(self) -> MasterRole:
        # k depends on the chain length, so the master is told again whenever it changes.
        role = MasterRole(store=self.store, cfg=self.cfg, chain_length=self._chain_length(),
                          **self._role_args)
        ray.get(self.master.configure_master.remote(role), timeout=CALL_TIMEOUT_S)
        return role

    def _standby_for(self, role: MasterRole, *, failover: bool = False) -> None:
        """Warms the next master in line (`RelayWorker.prepare_standby`) when it changed; one
        named at a failover starts following after the new master's first broadcast."""
        standby = self.order[1] if len(self.order) > 1 else None
        if standby is not None and standby != self._standby:
            self.relays[standby].prepare_standby.remote(role, after_failover=failover)
        self._standby = standby

    def _make_master(self, failover: bool = False) -> None:
        """Makes the chain's head the master and tells the publisher and callbacks; the next
        relay in line warms up as standby master (`RelayWorker.prepare_standby`)."""
        self._standby_for(self._configure_master(), failover=failover)
        master = self.master
        if self._publisher is not None:
            self._publisher.set_master(master)
        for callback in self._callbacks:
            callback(master)

    def _downstream(self, order: Sequence[str]) -> dict[str, list]:
        if self.topology == "fanout":
            return {order[0]: [self.relays[n] for n in order[1:]]}
        return {node: [] if down is None else [self.relays[down]]
                for node, (_, down) in chain.links(order).items()}

    def _wire(self, order: Sequence[str], only: set[str] | None = None) -> None:
        calls = [self.relays[node].set_downstream.remote(down)
                 for node, down in self._downstream(order).items()
                 if only is None or node in only]
        ray.get(calls, timeout=CALL_TIMEOUT_S)

    # ------------------------------------------------------------------ accessors
    @property
    def master_node(self) -> str:
        return self.order[0]

    @property
    def master(self) -> Any:
        return self.relays[self.order[0]]

    def relay_for(self, node_id: str) -> Any:
        try:
            return self.relays[node_id]
        except KeyError:
            raise KeyError(f"RelayGroup: no live relay on node {node_id!r}; "
                           f"relays are on {list(self.order)}") from None

    def status(self) -> dict[str, dict]:
        return dict(zip(self.order, ray.get([self.relays[n].status.remote() for n in self.order],
                                            timeout=CALL_TIMEOUT_S)))

    def standby_warm(self, timeout_s: float = 10.0) -> bool | None:
        """Whether the next master in line is warm (it ran a master step, `prepare_standby`)
        and has the master's newest version, served or prepared, with no read in flight; None
        when there is none. A master killed before its standby is warm fails over to a cold
        relay, whose first orbax restore takes seconds (the chaos benchmark and the relay
        cluster's failover test wait for this)."""
        with self._lock:
            if len(self.order) < 2:
                return None
            standby = self.relays[self.order[1]]
        try:
            return bool(ray.get(standby.status.remote(), timeout=timeout_s)["standby_caught_up"])
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def collect_events(self) -> list[dict]:
        """Drains every live relay's events into the group's sink; returns them."""
        with self._lock:
            refs = [self.relays[n].drain_events.remote() for n in self.order]
        recs = []
        for ref in refs:
            try:
                recs.extend(ray.get(ref, timeout=CALL_TIMEOUT_S))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass   # a dead relay's last events are lost; `check` reports the relay itself
        recs.sort(key=lambda r: r["t"])
        add = getattr(self._events, "add", None)
        for r in recs:
            if add is not None:
                add(r)
            else:
                self._events(r["kind"], **{k: v for k, v in r.items() if k != "kind"})
        return recs

    # ------------------------------------------------------------------ faults
    def check(self, timeout_s: float = 10.0) -> list[str]:
        """One heartbeat round; evicts relays whose actor is dead, re-links, and starts a new
        relay on each such node that is still alive (within the restart budget). Returns them."""
        with self._lock:
            return self._check(timeout_s)

    def _check(self, timeout_s: float) -> list[str]:
        self.checks += 1
        pings = {node: self.relays[node].ping.remote() for node in self.order}
        ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout_s)
        dead = []
        for node, ref in pings.items():
            try:
                ray.get(ref, timeout=0)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
                self._events("relay_slow", relay=node)
            except ray.exceptions.RayActorError:
                dead.append(node)
        master_died = any(node == self.order[0] for node in dead)
        for node in dead:
            self.remove(node, dead=True)
        alive = set(_alive_nodes())
        for node in dead:
            if node not in alive or node in self.relays or node in self._pending:
                continue
            if self.restarts >= self.max_restarts:
                self._events("relay_not_restarted", relay=node, restarts=self.restarts,
                             max_restarts=self.max_restarts)
                continue
            self.restarts += 1
            # After a failover the new master's first broadcast goes first: a relay process
            # starting (imports, a raylet worker) takes the cores that broadcast needs.
            after = self._served_by_master() if master_died and self.order else None
            self._pending[node] = _Restart(due=time.monotonic() + (RESTART_DEFER_S if master_died else 0.0),
                                           after=after)
        self._advance_restarts()
        return dead

    def _served_by_master(self) -> int:
        """The version the master serves (-1: none yet); a very large number when it does not
        answer at once, so a deferred restart does not wait on it."""
        try:
            snap = ray.get(self.master.latest.remote(), timeout=MASTER_POLL_S)
        except Exception:  # noqa: BLE001 - slow or dead: the next heartbeat handles the master
            return 1 << 62
        return -1 if snap is None else snap.version

    def _advance_restarts(self) -> None:
        """Moves each pending restart on without blocking: start the relay process when due (or
        once the master served a version newer than at the failover), link it into the chain
        once it answers, give up after CALL_TIMEOUT_S. The monitor calls this every round."""
        now = time.monotonic()
        for node, job in list(self._pending.items()):
            if job.handle is None:
                if job.after is not None and now < job.due and self._served_by_master() > job.after:
                    # the new master broadcast: its rollouts load that version next (a few
                    # tenths of a second); a process starting now would take their cores
                    job.due, job.after = min(job.due, now + RESTART_SETTLE_S), None
                if now < job.due and (job.after is None or self._served_by_master() <= job.after):
                    continue
                job.handle, job.ping, job.started = self._start(node), None, now
                job.ping = job.handle.ping.remote()
            ready, _ = ray.wait([job.ping], timeout=0)
            if not ready and now - job.started < CALL_TIMEOUT_S:
                continue
            del self._pending[node]
            try:
                ray.get(job.ping, timeout=0)
                if node not in set(_alive_nodes()):
                    raise RuntimeError("its node died meanwhile")
                self._link_new(node, job.handle)
            except Exception as e:  # noqa: BLE001 - its rollouts keep reading the store meanwhile
                self.relays.pop(node, None)
                self.order = tuple(n for n in self.order if n != node)
                ray.kill(job.handle, no_restart=True)
                self._events("relay_restart_failed", relay=node, error=repr(e))
                continue
            self._events("relay_restarted", relay=node, restarts=self.restarts)

    def start_monitor(self, interval_s: float) -> None:
        """`check()` on a daemon thread until `shutdown()`: every interval_s, and at once when a
        relay dies -- each relay holds one `watch` call, whose ref fails the moment its process
        goes, so a dead master is replaced in about the time Ray takes to notice, not a period."""
        def loop() -> None:
            watches: dict[str, Any] = {}
            # a group never shut down (a test) must not auto-start a Ray of its own after ray.shutdown
            while not self._monitor_stop.is_set() and ray.is_initialized():
                with self._lock:
                    for node in self.order:
                        if node not in watches:
                            watches[node] = self.relays[node].watch.remote(WATCH_S)
                ready, _ = ray.wait(list(watches.values()), num_returns=1, timeout=interval_s)
                if self._monitor_stop.is_set():
                    return
                with self._lock:
                    for node, ref in list(watches.items()):
                        if ref in ready or node not in self.relays:
                            del watches[node]
                try:
                    self.check()
                except Exception as e:  # noqa: BLE001 - the next round tries again
                    self._events("relay_error", message="check", error=repr(e))
        self._monitor = threading.Thread(target=loop, name="relay-monitor", daemon=True)
        self._monitor.start()

    @_locked
    def remove(self, node: str, *, dead: bool = False) -> None:
        """Takes a relay out of the chain (after a failure, or to retire its node)."""
        if node not in self.relays:
            raise KeyError(f"RelayGroup.remove: no relay on node {node!r}")
        old_order = self.order
        was_master = node == old_order[0]
        self.order = chain.relink(old_order, node)
        handle = self.relays.pop(node)
        self._events("relay_dead" if dead else "relay_removed", relay=node)
        if not dead:
            ray.kill(handle, no_restart=True)
        if not self.order:
            return
        self._events("relink", removed=node, order=list(self.order))
        if was_master:
            self._events("master_failover", old=node, new=self.order[0])
            self._wire(self.order, only={self.order[0]})
            self._make_master(failover=True)
        elif self.topology == "fanout":
            self._wire(self.order, only={self.order[0]})
        else:
            upstream = old_order[old_order.index(node) - 1]
            self._wire(self.order, only={upstream})
        if not was_master:
            self._standby_for(self._configure_master())

    @_locked
    def add(self, node: str) -> Any:
        """A relay on a new node, appended to the chain; it receives the current version."""
        if node in self.relays:
            raise ValueError(f"RelayGroup.add: node {node!r} already has a relay")
        handle = self._start(node)
        ray.get(handle.ping.remote(), timeout=CALL_TIMEOUT_S)
        return self._link_new(node, handle)

    def _link_new(self, node: str, handle: Any) -> Any:
        self.relays[node] = handle
        if not self.order:   # every other relay died meanwhile: this one is the chain
            self.order = (node,)
            self._events("relay_started", relay=node)
            self._make_master()
            return handle
        tail = self.order[-1]
        self.order = self.order + (node,)
        self._events("relay_started", relay=node)
        self._standby_for(self._configure_master())
        self._wire(self.order, only={self.order[0] if self.topology == "fanout" else tail})
        return self.relays[node]

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stops the monitor, then every relay (`RelayWorker.stop`: the master step and the
        standby's read in flight end, nothing new starts): after this no relay reads the weight
        store, so the learner may remove it. Relays that do not answer within timeout_s are
        left to `shutdown`'s kill."""
        self._monitor_stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=CALL_TIMEOUT_S)
        with self._lock:
            refs = [h.stop.remote(timeout_s) for h in self.relays.values()]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s + 5.0)

    def shutdown(self) -> None:
        """`stop`, then the relay processes are killed (and restarts still pending)."""
        self.stop()
        with self._lock:
            for handle in [*self.relays.values(), *(j.handle for j in self._pending.values())]:
                if handle is not None:
                    ray.kill(handle, no_restart=True)
            self.relays.clear()
            self._pending.clear()
        self.order = ()
