"""Where a rollout gets newer weights: its node's relay, or the weight store (relays off).

    newer_than(version)             -> (version, tensors) | None      answers at once
    wait_newer(version, timeout_s)  -> (version, tensors) | None      blocks until newer or timeout

tensors in the engine layout (Hugging Face names and shapes). With relays, the flat buffer is
mapped read-only from the relay's shared memory (or this node's object store) without a copy
(`weights.relay.read`); without, the rollout restores the orbax checkpoint itself, which is the
ablation of the paper's relay tier (section 4.1: storage on every rollout's critical path).

A rollout asks `newer_than` on every loop turn it may load weights. `RelaySource` answers that
from a version number a watcher thread keeps: one long-poll (`RelayWorker.wait_newer`) per version
instead of an RPC per turn, and the buffer is mapped only when a newer version exists. An idle
rollout blocks in `wait_newer` instead of spinning. The long-poll's answer names the served buffer,
so the rollout maps that one without asking the relay again: from a relay serving a version to
its rollouts holding it costs the long-poll's reply and a map, not a second call through a relay
that may be busy (a master just promoted restores and broadcasts on the same cores).
"""
from __future__ import annotations

import threading
import time
from typing import Any

import ray

# the watcher's long-poll: short enough that a relay replaced after a failure is found again soon
WATCH_POLL_S = 10.0
# after the relay failed, the watcher asks another relay this soon (then every retry_s)
FAILOVER_RETRY_S = 0.05
# while on another node's relay, the watcher goes home once this node's relay serves the same
# version; it waits this long for it after each version (the chain's next hop lags by ms)
HOME_WAIT_S = 0.5
# after the relay failed, rollouts wait this long for another relay before reading the store
FAILOVER_GRACE_S = 2.0
# relays off: how often an idle rollout lists the weight store while it waits
STORE_POLL_S = 0.05


def retry_plan(failures: int, was_foreign: bool, retry_s: float) -> tuple[bool, float]:
    """(avoid this node's relay, seconds to wait) before the watcher's next try, after its
    `failures`-th failure in a row. The first retry, at once: another node's relay when this
    node's failed, this node's when another's did (a master dying while this node's relay is
    back: no reason to wait for a third relay); the second, at once too, the other way round;
    then every retry_s."""
    return failures == 1 and not was_foreign, FAILOVER_RETRY_S if failures <= 2 else retry_s


class WeightSource:
    def newer_than(self, version: int) -> tuple[int, dict] | None:
        raise NotImplementedError

    def wait_newer(self, version: int, timeout_s: float) -> tuple[int, dict] | None:
        """`newer_than`, waiting up to `timeout_s` for a newer version (default: re-asks every
        STORE_POLL_S; sources that can be told override it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.newer_than(version)
            left = deadline - time.monotonic()
            if got is not None or left <= 0:
                return got
            time.sleep(min(STORE_POLL_S, left))

    def node(self) -> str | None:
        """The node the weights come from (the relay's, or the store's)."""
        return None

    def catching_up(self, version: int) -> bool:
        """A version newer than `version` is published and on its way to this source (only
        `RelaySource` ever says so): a rollout then waits for it, briefly, instead of starting
        a batch on weights already replaced."""
        return False

    def newest_published(self) -> int | None:
        """The newest version in the weight store, if this source can tell at once."""
        return None


class RelaySource(WeightSource):
    """The relay on this rollout's node (`weights.relay_group.local_relay`). While that relay is
    dead, restarting or not answering within call_timeout_s: another live relay of the group
    (found by name at once, it serves the same versions; back home once this node's relay
    serves them again), and `fallback` (the weight store) until one answers. A relay's death
    costs its rollouts a slower read, never the rollout. With no relay answering, the watcher
    looks them up again every retry_s."""

    def __init__(self, prefix: str, namespace: str | None = None, *, fallback: WeightSource | None = None,
                 call_timeout_s: float = 10.0, retry_s: float = 2.0):
        self.prefix, self.namespace = prefix, namespace
        self.fallback, self.call_timeout_s, self.retry_s = fallback, call_timeout_s, retry_s
        self._relay, self._node = None, None
        self._cond: threading.Condition | None = None   # made in the actor (not picklable)
        self._served = -1                                # newest version the relay served
        self._failing = False                            # the relay's last call failed
        self._foreign = False                            # reading another node's relay
        self._home_seen = False                          # this node's relay was found once
        self._failed_at = -float("inf")                  # when the relay's calls began to fail
        self.seen_t: float | None = None                 # wall time the watcher saw _served
        self._seen: tuple[Any, Any] | None = None         # (relay, Snapshot) of _served
        self.read_s: float | None = None                 # the last relay read (call + map)
        self._behind: tuple[int, float] | None = None    # (store's newest, when first seen unserved)
        self.rpcs = 0                                    # relay calls made (tests count them)
        self.pull_rpcs = 0                               # ... of them by a pull (not the watcher)
        self.via = "relay"          # where the last answer came from: "relay" or "store"
        self.fallbacks = 0
        self.last_error: str | None = None

    def __getstate__(self):
        return {"prefix": self.prefix, "namespace": self.namespace, "fallback": self.fallback,
                "call_timeout_s": self.call_timeout_s, "retry_s": self.retry_s}

    def __setstate__(self, state):
        self.__init__(state.pop("prefix"), state.pop("namespace"), **state)

    def node(self) -> str | None:
        if self.via == "store" and self.fallback is not None:
            return self.fallback.node()
        if self._node is None and self._relay is not None:
            try:
                self._node = ray.get(self._relay.node_id.remote(), timeout=self.call_timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return None
        return self._node

    def _handle(self, *, avoid_home: bool = False):
        """This node's relay; while it is dead or not registered (or `avoid_home`, right after it
        failed), another live relay of the group: its version is the same, read from its shared
        buffer (same host) or its node's object store, which is far cheaper than a store restore."""
        from laminar_jax.weights.relay_group import local_relay
        if self._relay is None:
            home = None
            if not (avoid_home and self._home_seen):
                try:
                    home = local_relay(self.prefix, self.namespace)
                except ValueError:   # dead, restarting, or not registered yet
                    if not self._home_seen:   # at start-up: wait for this node's own relay
                        raise
            # a relay's node is in its name ({prefix}:{node}): no call to ask it
            self._relay, self._node = home, None if home is None else ray.get_runtime_context().get_node_id()
            self._foreign = home is None
            self._home_seen = True
            if home is None:
                self._relay, self._node = self._other_relay()
                if self._relay is None:
                    raise ValueError(f"no live relay named {self.prefix}:*")
        return self._relay

    def _other_relay(self):
        here = ray.get_runtime_context().get_node_id()
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith(self.prefix + ":") and a["name"] != f"{self.prefix}:{here}"
                       and (self.namespace is None or a.get("namespace") == self.namespace))
        for name in names:
            try:
                return ray.get_actor(name, namespace=self.namespace), name[len(self.prefix) + 1:]
            except ValueError:
                continue
        return None, None

    def _go_home(self) -> None:
        """Back to this node's relay once it serves what the foreign one did (watcher thread)."""
        from laminar_jax.weights.relay_group import local_relay
        try:
            home = local_relay(self.prefix, self.namespace)
            # the version just seen on the foreign relay reaches this node's own a hop later
            snap = ray.get(home.wait_newer.remote(self._served - 1, HOME_WAIT_S),
                           timeout=HOME_WAIT_S + self.call_timeout_s)
        except Exception:  # noqa: BLE001 - not back yet
            return
        if snap is not None and snap.version >= self._served:
            with self._cond:
                self._relay, self._node, self._foreign = home, ray.get_runtime_context().get_node_id(), False

    def _fail(self, e: BaseException) -> None:
        if not self._failing:
            self._failed_at = time.monotonic()
        self._relay, self._failing = None, True
        self.fallbacks += 1
        self.last_error = f"{type(e).__name__}: {e}"

    def _start_watcher(self) -> None:
        if self._cond is None:
            self._cond = threading.Condition()
            threading.Thread(target=self._watch, name="relay-watch", daemon=True).start()

    def _watch(self) -> None:
        """Long-polls the relay for the next served version and records its number. When the
        relay fails, another relay of the group is asked at once (`_handle`), and a quick
        `latest` call on it ends the store fallback; with none answering, the lookup is retried
        every retry_s. While on another relay, this node's own is tried again after each poll;
        when that other relay is the one that fails (a master dying while this node's relay is
        back), the first retry goes home."""
        fresh, failures, avoid_home = True, 0, False
        while ray.is_initialized():   # never auto-start a Ray of its own after a shutdown
            try:
                relay = self._handle(avoid_home=avoid_home)
                self.rpcs += 1
                if fresh:   # just (re)connected: answer at once, so rollouts stop reading the store
                    snap = ray.get(relay.latest.remote(), timeout=self.call_timeout_s)
                else:
                    snap = ray.get(relay.wait_newer.remote(self._served, WATCH_POLL_S),
                                   timeout=WATCH_POLL_S + self.call_timeout_s)
            except Exception as e:  # noqa: BLE001 - relay restarting or gone: look it up again
                with self._cond:
                    was_foreign = self._foreign
                    self._fail(e)
                    self._cond.notify_all()
                failures += 1
                fresh = True
                avoid_home, wait_s = retry_plan(failures, was_foreign, self.retry_s)
                time.sleep(wait_s)
                continue
            fresh, failures, avoid_home = False, 0, False
            with self._cond:
                self._failing = False
                if snap is not None and snap.version > self._served:
                    self._served, self.seen_t, self._seen = snap.version, time.time(), (relay, snap)
                self._cond.notify_all()
            if self._foreign:
                self._go_home()

    def _pull(self, version: int) -> tuple[int, dict] | None:
        from laminar_jax.weights import flat
        from laminar_jax.weights.relay import pull

        t0 = time.perf_counter()
        try:
            got = self._read_seen(version)
            if got is None:   # superseded since the watcher saw it: ask the relay for its newest
                self.rpcs += 1
                self.pull_rpcs += 1
                got = pull(self._handle(), newer_than=version, timeout_s=0.0, call_timeout_s=self.call_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ValueError, OSError) as e:
            # dead, restarting, or not registered yet (get_actor's ValueError); OSError: the
            # shared buffer of a relay process that just died cannot be mapped any more
            if self.fallback is None:
                raise
            self._fail(e)
            return self._from_store(version) if self._use_store() else None
        self.via = "relay"
        if got is None or got[0] <= version:
            return None
        out = got[0], flat.unflatten(got[1], got[2])
        self.read_s = time.perf_counter() - t0
        return out

    def _read_seen(self, version: int) -> tuple[int, Any, Any] | None:
        """(version, buffer, index) of the snapshot the watcher's long-poll returned, when it is
        newer than `version` and its buffer is still there (`relay.read`: mapped, no call on the
        same host); None when the relay has replaced it since (the caller asks for the newest)."""
        from laminar_jax.weights import shared_buffer
        from laminar_jax.weights.relay import read

        with self._cond:
            seen = self._seen
        if seen is None or seen[1].version <= version:
            return None
        relay, snap = seen
        try:
            return snap.version, read(relay, snap, call_timeout_s=self.call_timeout_s), snap.index
        except (shared_buffer.BufferGone, ray.exceptions.RayError):
            return None   # replaced, or its relay died with the object-store copy: ask again

    def _use_store(self) -> bool:
        """Read the store: the relay failed more than FAILOVER_GRACE_S ago and none answers yet
        (within the grace the watcher finds another relay: a relay read is a map, a store read
        a restore that takes a rollout seconds)."""
        return (self._failing and self.fallback is not None
                and time.monotonic() - self._failed_at >= FAILOVER_GRACE_S)

    def catching_up(self, version: int) -> bool:
        """The store holds a version newer than both `version` and what the relays serve, first
        seen less than FAILOVER_GRACE_S ago: it is on its way (a normal broadcast takes a
        fraction of a second; after a master's death the new master restores it, in about a
        broadcast). A rollout that started a batch on its old weights meanwhile would keep
        them for that whole batch (laminar mode loads between batches): it waits instead, at
        most the grace per version. A store this node cannot read never says so."""
        if self.fallback is None:
            return False
        newest = self.fallback.newest_published()
        if newest is None or newest <= max(version, self._served):
            return False
        if self._behind is None or self._behind[0] != newest:
            self._behind = (newest, time.monotonic())
        return time.monotonic() - self._behind[1] < FAILOVER_GRACE_S

    def _from_store(self, version: int) -> tuple[int, dict] | None:
        self.via = "store"
        return self.fallback.newer_than(version)

    def newer_than(self, version: int) -> tuple[int, dict] | None:
        self._start_watcher()
        if self._use_store():
            return self._from_store(version)
        with self._cond:
            if self._failing or self._served <= version:
                return None
        return self._pull(version)

    def wait_newer(self, version: int, timeout_s: float) -> tuple[int, dict] | None:
        self._start_watcher()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._use_store() and (self._failing or self._served <= version):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if self._failing and self.fallback is not None:   # wake when the grace ends
                    left = min(left, FAILOVER_GRACE_S - (time.monotonic() - self._failed_at))
                self._cond.wait(max(left, 0.01))
        if self._use_store():   # polls the store until the deadline, or a relay answers again
            return WeightSource.wait_newer(self, version, max(0.0, deadline - time.monotonic()))
        return self._pull(version)


class StoreSource(WeightSource):
    """Reads the newest finalized version straight from the learner's weight store, through a
    pin (`master.read_pinned`): the master prunes a version once it holds a newer one, and a
    read it pruned under would fail half-way (and print tensorstore's "Event loop is closed")."""

    def __init__(self, store: Any, model_cfg: Any):
        self.store, self.model_cfg = store, model_cfg

    def node(self) -> str | None:
        return self.store.node_id

    def newest_published(self) -> int | None:
        versions = self.store.versions()   # a directory listing of finalized versions
        return versions[-1] if versions else None

    def newer_than(self, version: int) -> tuple[int, dict] | None:
        from laminar_jax.models.hf import params_to_hf
        from laminar_jax.weights.master import read_pinned

        versions = self.store.versions()
        if not versions or versions[-1] <= version:
            return None
        try:
            tree = read_pinned(self.store, versions[-1])
        except (FileNotFoundError, ValueError):  # the store removed (the run ended): next poll
            return None
        if tree is None:   # pruned before it was pinned: a newer one is there, next poll
            return None
        return versions[-1], params_to_hf(self.model_cfg, tree)
