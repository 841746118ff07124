"""RolloutWorker: one engine, the loop of DESIGN.md, and the manager's release / adopt.

    loop:
        if my batch is done, or I was released (partial mode: at any time):
            load the newest weights from the local relay (or the weight store)
        take whole prompt groups up to max_concurrency        (the mode may hold some back)
        engine.step()                                          every running request +1 token
        stream in-flight tokens to the PartialPool             every few tokens / seconds
        finished group -> rewards -> ExperienceBuffer          with behaviour log-probs,
                                                               gen_version, rollout id, timings
    release(version) -> (groups, partials)   abort everything, hand back, pull newer weights
    adopt(version, groups, partials) -> ok   re-prefill partials on the same version, go on

The loop runs in `run()` (a long actor call); the other methods are called by the manager and
the driver from other threads of the same actor and take the same lock, between engine steps.
No JAX import at module level: the engine module brings its own (a GPU rollout with vLLM needs
none).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

import ray

from laminar_jax.data.records import PartialTrajectory, PromptGroup, Trajectory, parse_request_id, request_id
from laminar_jax.env.protocol import EnvStateError
from laminar_jax.manager import modes
from laminar_jax.weights.source import WeightSource
from rollout.engine import Request, SamplingParams
from rollout.episode import done_state, is_done_state
from rollout.multiturn import MultiTurn
from rollout.rpc import call, node_id, send
from rollout.scoring import GroupScorer, GroupState

# longest an idle rollout blocks waiting for newer weights before it asks the data actor for work
# again (work not tied to a new version: re-queued groups, a buffer that drained)
IDLE_WAIT_S = 0.1
# a data-actor call (issue, deliver, reject) answers in milliseconds; one unanswered this long is
# a hung data actor: the rollout fails with an error naming the call (the manager's heartbeat
# sees it and replaces the rollout) instead of holding its lock, and so its heartbeats, for good
DATA_CALL_TIMEOUT_S = 60.0


class RolloutWorker:
    """`RolloutWorker(rollout_id, cfg, data, weights, make_engine, tokenizer, reward)`.

    weights: a `WeightSource` (local relay or weight store). make_engine(cfg_model, params_tree)
    builds the engine on the first weights. tokenizer: decodes completions for the reward and
    gives the stop tokens. reward: a `RewardScorer`.
    """

    def __init__(self, rollout_id: str, cfg: Any, data: Any, weights: WeightSource,
                 make_engine: Callable, tokenizer: Any, reward: Any):
        self.id, self.cfg, self.data, self.weights = rollout_id, cfg, data, weights
        self.mode = cfg.manager.mode
        self._make_engine, self.tokenizer, self.reward = make_engine, tokenizer, reward
        self.engine = None
        self.groups: dict[str, GroupState] = {}
        self.undelivered: list[list[Trajectory]] = []
        self._lock, self._stop = threading.RLock(), threading.Event()
        self._released, self.failed = False, None
        self._events: list[dict] = []
        self._steps_since_stream, self._last_stream = 0, time.time()
        self._last_poll = 0.0
        self._had_work, self._free_since = False, None
        # Highest KV use of the batch in hand: the manager's ramp-down test compares against it.
        self._kv_peak = 0.0
        # time split (seconds): decode = engine steps, pull = reading newer weights, reload =
        # engine build / weight load, rpc = data-actor calls, reward = decode text + score, wait =
        # blocked waiting for weights while idle (part of idle_s, with the idle loop turns)
        self.counters = dict(idle_s=0.0, busy_s=0.0, decode_s=0.0, pull_s=0.0, reload_s=0.0, rpc_s=0.0,
                             reward_s=0.0, wait_s=0.0, tokens=0, steps=0, kv_time=0.0, pulls=0,
                             groups_delivered=0, reward_errors=0, decode_errors=0, released=0, adopted=0, interrupts=0,
                             catch_up_waits=0, release_refused=0, restore_failures=0)
        r = cfg.rollout
        self.sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                       max_new_tokens=r.max_new_tokens,
                                       stop_token_ids=tuple(tokenizer.stop_token_ids))
        self.groups_per_batch = max(1, r.max_concurrency // cfg.data.group_size)
        # finished groups are scored off the decode loop
        self.scorer = GroupScorer(rollout_id, tokenizer, self.sampling.stop_token_ids, reward, self.counters,
                                  self._event)
        # multi-turn (env.name set): trajectories alternate engine turns and env steps
        self.turns = None
        env_cfg = getattr(cfg, "env", None)
        if env_cfg is not None and env_cfg.name is not None:
            from laminar_jax.env.registry import resolve_env
            self.turns = MultiTurn(resolve_env(env_cfg), env_cfg, tokenizer, self.sampling, self._decode_turn,
                                   rollout_id=rollout_id, allow_mixed=modes.interrupts_on_publish(self.mode))

    def _decode_turn(self, tokens) -> str:
        """A turn's text for env.step (stop tokens left out; an undecodable id reads as U+FFFD)."""
        try:
            return self.tokenizer.decode([int(x) for x in tokens if int(x) not in self.sampling.stop_token_ids])
        except Exception:  # noqa: BLE001 - the environment sees the text the model failed to write
            self.counters["decode_errors"] += 1
            return "\ufffd"

    def _in_flight(self) -> bool:
        """Requests in the engine, or trajectories waiting on their environment between turns
        (one weight version per trajectory: no pull under them)."""
        busy = self.engine.has_unfinished() if self.engine is not None else False
        return busy or (self.turns is not None and self.turns.waiting() > 0)

    # ------------------------------------------------------------------ the loop
    def run(self) -> str | None:
        """Runs until `stop()`; returns the failure message if the engine or loop died."""
        try:
            self._first_engine()
        except Exception as e:  # noqa: BLE001 - a failed build is an engine death too
            self.failed = f"{type(e).__name__}: {e}"
            self._event("rollout_failed", error=self.failed)
            return self.failed
        while not self._stop.is_set():
            t0 = time.time()
            try:
                if self.engine is None:
                    worked = self._start_engine()
                else:
                    with self._lock:
                        worked = self._tick()
            except Exception as e:  # engine death: recorded; the manager evicts this rollout
                self.failed = f"{type(e).__name__}: {e}"
                self._event("rollout_failed", error=self.failed)
                return self.failed
            self.counters["busy_s" if worked else "idle_s"] += time.time() - t0
            if not worked:
                self._idle_wait()
        return None

    def _first_engine(self) -> None:
        """Waits for the first weights and builds the engine outside the lock, so heartbeats
        (`stats`) answer during the build (a cold compile can take longer than their timeout)."""
        while self.engine is None and not self._stop.is_set():
            t0 = time.perf_counter()
            got = self.weights.wait_newer(-1, IDLE_WAIT_S)
            self.counters["idle_s"] += time.perf_counter() - t0
            self.counters["wait_s"] += time.perf_counter() - t0
            if got is None:
                continue
            engine, build = self._build(*got)
            self.counters["reload_s"] += build["build_s"]
            self.counters["busy_s"] += build["build_s"]
            with self._lock:
                self.engine = engine
                self._pulled(got[0], False, **build)

    def _build(self, version: int, tensors: dict) -> tuple[Any, dict]:
        """The engine on the first weights, and its pull event's fields: build_s, and
        imports_warm (its modules were imported, or being imported, before the weights came:
        the factory's `imports_started`, after the spawner's warm_imports)."""
        warm = getattr(self._make_engine, "imports_started", lambda: None)()
        t0 = time.perf_counter()
        engine = self._make_engine(tensors, version)
        return engine, {"imports_warm": warm, "build_s": time.perf_counter() - t0}

    def _idle_wait(self) -> None:
        """Nothing to generate: block (outside the lock, so the manager's calls go on) until newer
        weights arrive or IDLE_WAIT_S passes, instead of spinning; what came is loaded at once.
        Idle means nothing in flight, so any mode may load weights now. While groups are being
        scored, block on their rewards instead, so a scored group is delivered the moment it is
        (waiting on the weights there held the batch's last group back by up to IDLE_WAIT_S: in
        sync mode, every step)."""
        if self.scorer.busy():
            t0 = time.perf_counter()
            self.scorer.wait(IDLE_WAIT_S)
            waited = time.perf_counter() - t0
            self.counters["idle_s"] += waited
            self.counters["reward_s"] += waited
            return
        current = -1 if self.engine is None else self.engine.weight_version
        t0 = time.perf_counter()
        got = self.weights.wait_newer(current, IDLE_WAIT_S)
        waited = time.perf_counter() - t0   # the read of what came included
        self.counters["idle_s"] += waited
        self.counters["wait_s"] += waited
        if got is None:
            return
        with self._lock:
            now = -1 if self.engine is None else self.engine.weight_version
            in_flight = self._in_flight()
            if got[0] > now and modes.may_pull_weights(self.mode, in_flight=int(in_flight), released=self._released):
                self._load(got, in_flight)

    def _tick(self) -> bool:
        in_flight = self._in_flight()
        if self._had_work and not in_flight:   # the batch in hand just ended (pull events say when)
            self._free_since = time.time()
        self._had_work = in_flight
        if modes.may_pull_weights(self.mode, in_flight=int(in_flight), released=self._released):
            self._maybe_pull(in_flight)
        if self.engine is None:
            return False
        self._retry_undelivered()
        # groups being scored count as undelivered: new work waits for them as it did when scoring
        # blocked the loop (the mode's batch rules are unchanged); decoding goes on meanwhile
        if not self.undelivered and not self.scorer.busy() and (not self.groups or modes.refills_continuously(self.mode)) \
                and not self._catching_up():
            self._take()
        if self.turns is not None:
            self._poll_turns()
            if not self.engine.has_unfinished() and self.turns.waiting():
                time.sleep(0.002)  # every trajectory waits on its tool: nothing to decode
                return True
        if not self.engine.has_unfinished():
            return False
        t0 = time.perf_counter()
        finished = self.engine.step()
        self.counters["decode_s"] += time.perf_counter() - t0
        stats = self.engine.stats()
        self._kv_peak = max(self._kv_peak, stats.kv_used)
        self.counters["steps"] += 1
        self.counters["tokens"] += stats.num_running + len(finished)
        self.counters["kv_time"] += stats.kv_used
        for c in finished:
            if self.turns is not None and self.turns.owns(c.request_id):
                self.turns.on_completion(c)   # a turn ended: env.step runs off the loop
            else:
                self._finish_sample(c)
        self._steps_since_stream += 1
        d = self.cfg.data
        if self._steps_since_stream >= d.partial_every_tokens or time.time() - self._last_stream > d.partial_every_s:
            self._stream()
        return True

    def _start_engine(self) -> bool:
        """The first pull builds the engine outside the lock: a vLLM start takes tens of seconds,
        and the manager's heartbeats (`stats`, version -1 meanwhile) must answer in time."""
        if time.time() - self._last_poll < 0.02:
            return False
        self._last_poll = time.time()
        got = self.weights.newer_than(-1)
        if got is None:
            return False
        engine, build = self._build(*got)
        with self._lock:
            self.engine = engine
            self._pulled(got[0], False, **build)
        return True

    def _maybe_pull(self, in_flight: bool) -> None:
        now = time.time()
        if now - self._last_poll < 0.02 and self.engine is not None:
            return
        self._last_poll = now
        current = -1 if self.engine is None else self.engine.weight_version
        t0 = time.perf_counter()
        got = self.weights.newer_than(current)
        self.counters["pull_s"] += time.perf_counter() - t0
        if got is not None:
            self._load(got, in_flight)

    def _load(self, got: tuple[int, dict], in_flight: bool) -> None:
        version, tensors = got
        t0, build = time.perf_counter(), {}
        if self.engine is None:
            self.engine, build = self._build(version, tensors)
        else:
            partials = self.engine.abort([p.request_id for p in self.engine.partials()]) if in_flight else []
            self.engine.load_weights(tensors, version)
            self.engine.add([p.to_request() for p in partials])
            self.counters["interrupts"] += bool(partials)
        self.counters["reload_s"] += time.perf_counter() - t0
        self._pulled(version, in_flight, load_s=time.perf_counter() - t0, **build)

    def _pulled(self, version: int, in_flight: bool, load_s: float | None = None, **build) -> None:
        self._released = False
        self.counters["pulls"] += 1
        # seen_t: when the source learnt of the newest version (a relay's watcher); read_s: its
        # read; load_s: the engine's load. The time from a relay serving a version to its
        # rollout holding it splits into these and the wait for the rollout's batch to end
        # (free_since: when the last batch's work ended; laminar mode loads only between batches).
        self._event("pull", version=version, interrupted=int(in_flight), engine=getattr(self.engine, "kind", None),
                    node=node_id(), relay_node=self.weights.node(), seen_t=getattr(self.weights, "seen_t", None),
                    read_s=getattr(self.weights, "read_s", None), load_s=load_s, free_since=self._free_since, **build)

    def _catching_up(self) -> bool:
        """Newer weights are published and the source is failing over to reach them (bounded by
        its grace): new work waits for them, or it would run a whole batch on replaced weights."""
        if not self.weights.catching_up(self.engine.weight_version):
            return False
        self.counters["catch_up_waits"] += 1
        return True

    def _take(self) -> None:
        free = self.groups_per_batch - len(self.groups)
        if free <= 0:
            return
        t0, decided = time.perf_counter(), time.time()
        groups = self._data_call("issue", free, self.id, self.engine.weight_version)
        self.counters["rpc_s"] += time.perf_counter() - t0
        if not groups:
            return
        if not self.groups:  # a new batch: its ramp-down is measured from its own peak
            self._kv_peak = 0.0
        # Fresh work on the current version ends a release: a rollout released while no newer
        # weights exist starts its next batch here, and a pull under that batch would interrupt it
        # and mix versions in its trajectories.
        self._released = False
        now = time.time()
        # decided_t: when the rollout chose to start work on these weights (before the issue
        # call, which may take a while on a loaded machine: a version published meanwhile was
        # not there to wait for)
        self._event("batch", version=self.engine.weight_version, group_ids=[g.group_id for g in groups],
                    fresh=not self.groups, decided_t=decided)
        for g in groups:
            self.groups[g.group_id] = GroupState(g, now)
            try:
                self.engine.add(self.turns.start(g, self.engine.weight_version) if self.turns is not None else
                                [Request(rid, g.prompt_tokens, self.sampling, g.group_id) for rid in g.request_ids()])
            except ValueError as e:  # a prompt the engine cannot take: counted, never dropped silently
                self.engine.abort(g.request_ids())
                if self.turns is not None:
                    self.turns.drop(g.request_ids())
                del self.groups[g.group_id]
                self._data_call("reject", g.group_id, str(e))
                self._event("group_rejected", group_id=g.group_id, error=str(e))

    # ------------------------------------------------------------------ finished samples
    def _record(self, p, finish_reason: str | None, group: GroupState, index: int) -> PartialTrajectory:
        mask = None if self.turns is None else self.turns.loss_mask(p.request_id, len(p.response_tokens))
        return PartialTrajectory(p.group_id, index, self.id, p.prompt_tokens, p.response_tokens,
                                 p.raw_logp, p.logp, p.versions, group.group.prompt_id,
                                 group.repacks.get(index, 0), finish_reason, loss_mask=mask)

    def _poll_turns(self) -> None:
        """Tool results back: continue those trajectories in the engine, deliver finished ones."""
        conts, finished = self.turns.poll(self.engine.weight_version)
        for req in conts:
            try:
                self.engine.add([req])
            except ValueError:  # the context is full: the trajectory ends here
                finished.append(self.turns.truncate(req.id))
        for error in self.turns.errors:
            self._event("env_error", **error)
        self.turns.errors.clear()
        for error in self.turns.state_errors:  # such a trajectory stays here (no repack, no failover)
            self._event("env_state_error", env=self.cfg.env.name, error=error[:300])
        self.turns.state_errors.clear()
        ended = self.turns.released()
        if ended:  # their kept K/V (env.kv_policy: keep) go back to the engine's pool
            self.engine.abort(ended)
        for f in finished:
            group = self.groups.get(f.partial.group_id)
            if group is None:  # released or re-issued meanwhile
                continue
            i = f.partial.sample_index
            group.done[i] = dataclasses.replace(f.partial, prompt_id=group.group.prompt_id,
                                                repack_count=group.repacks.get(i, 0),
                                                episode=done_state(f.reward, f.stats, f.timings))
            group.env[i] = (f.reward, f.stats)
            group.timings[i] = f.timings
            if len(group.done) == group.group.group_size:
                del self.groups[f.partial.group_id]
                self._score(group)

    def _finish_sample(self, c) -> None:
        gid, index = parse_request_id(c.request_id)
        group = self.groups[gid]
        group.done[index] = self._record(c, c.finish_reason, group, index)
        group.timings[index] = (c.timings.first_token or c.timings.finished, c.timings.finished)
        if len(group.done) == group.group.group_size:
            del self.groups[gid]
            t0 = time.perf_counter()
            self._score(group)  # hands the group to the reward pool (scored off the decode loop)
            self.counters["reward_s"] += time.perf_counter() - t0
            self._retry_undelivered()

    def _score(self, group: GroupState) -> None:
        g = group.group
        if self.turns is not None:  # the environment's rewards: nothing to score
            rewards = [group.env[i][0] for i in range(g.group_size)]
            self.undelivered.append(self.scorer.trajectories(group, rewards, self.engine.weight_version))
        else:
            self.scorer.submit(group)

    def _retry_undelivered(self) -> None:
        self.undelivered.extend(self.scorer.collect(self.engine.weight_version))
        while self.undelivered:
            t0 = time.perf_counter()
            ok = self._data_call("deliver", self.undelivered[0])
            self.counters["rpc_s"] += time.perf_counter() - t0
            if not ok:
                return  # buffer full: back-pressure, retry next tick
            self.undelivered.pop(0)
            self.counters["groups_delivered"] += 1

    def _data_call(self, name: str, *args: Any) -> Any:
        try:
            return call(getattr(self.data, name), *args, timeout=DATA_CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"rollout {self.id}: the data actor's {name}() did not answer within "
                               f"{DATA_CALL_TIMEOUT_S:g} s") from None

    def _snapshot(self) -> list[PartialTrajectory]:
        if self.turns is not None:  # every live trajectory, in the engine or waiting on its env
            out = [dataclasses.replace(p, prompt_id=self.groups[p.group_id].group.prompt_id,
                                       repack_count=self.groups[p.group_id].repacks.get(p.sample_index, 0))
                   for p in self.turns.snapshot(self.engine.partials()) if p.group_id in self.groups]
            return out + [p for g in self.groups.values() for p in g.done.values()]
        out = []
        for p in self.engine.partials():
            gid, index = parse_request_id(p.request_id)
            out.append(self._record(p, None, self.groups[gid], index))
        return out + [p for g in self.groups.values() for p in g.done.values()]

    def _stream(self) -> None:
        t0 = time.perf_counter()
        send(self.data.update_partials, self._snapshot())  # the loop never waits on it
        self.counters["rpc_s"] += time.perf_counter() - t0
        self._steps_since_stream, self._last_stream = 0, time.time()

    # ------------------------------------------------------------------ manager calls
    def release(self, version: int) -> tuple[list[PromptGroup], list[PartialTrajectory]] | None:
        """Abort and hand back every unfinished group (repack source); None if no longer on
        `version` or nothing is running. The next tick pulls the newest weights."""
        with self._lock:
            if self.engine is None or self.engine.weight_version != version or not self.groups:
                return None
            snapshot = self._snapshot()
            if self.turns is not None and not self._movable(snapshot):
                return None
            self.engine.abort([p.request_id for p in self.engine.partials()])
            if self.turns is not None:  # their steps in flight are abandoned, kept K/V given back
                self.turns.drop(list(self.turns.episodes))
                self.engine.abort(self.turns.released())
            groups = [g.group for g in self.groups.values()]
            self.groups.clear()
            self._released = True
            self._kv_peak = 0.0
            self.counters["released"] += 1
            self._event("released", version=version, groups=len(groups), trajectories=len(snapshot))
            return groups, snapshot

    def adopt(self, version: int, groups: list[PromptGroup], partials: list[PartialTrajectory]) -> bool:
        """Take over groups on the same weight version (repack destination, failover); each
        unfinished trajectory is re-prefilled (prompt + its tokens so far) and continues (a
        multi-turn one from its last turn boundary, `_resume_turns`)."""
        with self._lock:
            if self.engine is None or self.engine.weight_version != version:
                return False
            by_group = {g.group_id: GroupState(g, time.time()) for g in groups}
            requests = []
            for p in partials:
                if p.num_tokens and int(p.token_versions.min()) != version and not modes.interrupts_on_publish(self.mode):
                    raise ValueError(f"adopt: trajectory {p.key} has tokens of version "
                                     f"{int(p.token_versions.min())}, this rollout is on {version}")
            if self.turns is not None:
                requests, partials = self._resume_turns(version, by_group, partials), []
            for p in partials:
                group = by_group[p.group_id]
                group.repacks[p.sample_index] = p.repack_count
                if p.finish_reason is not None:
                    group.done[p.sample_index] = p
                    continue
                requests.append(Request(request_id(p.group_id, p.sample_index), p.prompt_tokens, self.sampling,
                                        p.group_id, p.response_tokens, p.sample_logp, p.behaviour_logp,
                                        p.token_versions))
            self.engine.add(requests)
            self.groups.update(by_group)
            for gid, group in by_group.items():
                if len(group.done) == group.group.group_size:
                    del self.groups[gid]
                    self._score(group)
            # A rollout released earlier and not yet ticked would otherwise pull newer weights
            # under the adopted work: it holds a batch of this version again, to be drained.
            self._released = False
            moved = sum(len(g.repacks) for g in by_group.values())
            self.counters["adopted"] += moved
            self._event("adopted", version=version, groups=len(groups), trajectories=moved)
            return True

    def _movable(self, snapshot: list[PartialTrajectory]) -> bool:
        """Whether every trajectory of a multi-turn release carries its episode state; else the
        release is refused (the work finishes here) and the first refusal is logged with why."""
        stuck = [p for p in snapshot if p.episode is None]
        if not stuck:
            return True
        self.counters["release_refused"] += 1
        if self.counters["release_refused"] == 1:
            self._event("release_refused", env=self.cfg.env.name, trajectories=len(stuck),
                        reason=f"env {self.cfg.env.name!r}: trajectory {stuck[0].group_id}/{stuck[0].sample_index} "
                               "has no episode state (an environment without snapshot() / restore(row, state), "
                               "or one whose snapshot failed: see env_state_error)")
        return False

    def _resume_turns(self, version: int, by_group: dict, partials: list[PartialTrajectory]) -> list[Request]:
        """Adopted multi-turn trajectories: finished ones wait for their group, the others go on
        from their last turn boundary (`MultiTurn.resume`); a sample with no record, or whose
        state cannot be restored (logged and counted, naming the env), starts again from its row."""
        requests, resumed = [], set()
        for p in partials:
            group = by_group[p.group_id]
            i = p.sample_index
            group.repacks[i] = p.repack_count
            if p.finish_reason is not None and is_done_state(p.episode):
                group.done[i] = p
                group.env[i] = (float(p.episode["reward"]), dict(p.episode["stats"]))
                group.timings[i] = tuple(p.episode["timings"])
                continue
            try:
                req = self.turns.resume(group.group.row, p, version)
            except EnvStateError as e:
                self.counters["restore_failures"] += 1
                self._event("env_restore_failed", env=self.cfg.env.name, group_id=p.group_id, sample_index=i,
                            error=str(e)[:300])
                continue
            resumed.add(p.key)
            if req is not None:
                requests.append(req)
        for gid, group in by_group.items():
            fresh = [i for i in range(group.group.group_size) if (gid, i) not in resumed and i not in group.done]
            if fresh:
                requests += self.turns.start(group.group, version, indices=fresh)
        return requests

    def stats(self) -> dict:
        """Heartbeat: engine stats, counters, failure. `kv_peak` is the highest KV use since the
        batch in hand began (the manager's ramp-down reference); `num_running` counts waiting
        requests too."""
        with self._lock:
            s = self.engine.stats() if self.engine is not None else None
            return {"id": self.id, "failed": self.failed, "node": node_id(),
                    "version": -1 if s is None else s.weight_version, "kv_used": 0.0 if s is None else s.kv_used,
                    "kv_peak": 0.0 if s is None else max(self._kv_peak, s.kv_used) if self.groups else s.kv_used,
                    "num_running": 0 if s is None else s.num_running + s.num_waiting,
                    "num_waiting": 0 if s is None else s.num_waiting,
                    "groups": len(self.groups), **self.counters,
                    **({f"env_{k}": v for k, v in self.turns.counters.items()} if self.turns is not None else {}),
                    "reward": self.reward.health() if hasattr(self.reward, "health") else None}

    def drain_events(self) -> list[dict]:
        with self._lock:
            out, self._events = self._events, []
            return out

    def _event(self, kind: str, **fields) -> None:
        self._events.append({"kind": kind, "rollout": self.id, "t": time.time(), **fields})

    def stop(self) -> None:
        self._stop.set()
        if self.turns is not None:
            self.turns.close()
        if hasattr(self.reward, "close"):  # the reward processes
            self.reward.close()
