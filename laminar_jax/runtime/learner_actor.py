"""The learner actor: sample whole groups, update, version += 1, publish without waiting.

One `step()` is one RL iteration (paper section 4: a version is one global batch):

    groups   <- data.sample(...)              FIFO, or one global batch (global-batch modes);
                                              mini-batch by mini-batch as they finish (stream)
    batch    <- assemble(groups)              fixed shapes per length bucket
    A        <- advantages (per group)        prox_logp / ref_logp when the loss needs them
    K x      state <- train(state, mini-batch)
    mismatch metrics                           this version's log-probs from the train step's
                                              forward where it covers the batch (engine_metrics)
    version += 1; publisher.publish(version, params)     returns after the device-to-host copy;
                                              a writer thread runs the orbax save
    checkpoint every run.checkpoint_every versions or run.checkpoint_every_s seconds (orbax,
    async); its "checkpoint" event comes once orbax has committed it. It and the publisher's
    writer take turns (`orbax_saves`: one orbax save and its commit at a time per process)
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import ray

from laminar_jax.env.metrics import tool_step_metrics
from laminar_jax.manager import modes
from laminar_jax.metrics import exact_rate
from laminar_jax.runtime import batch as B
from laminar_jax.runtime import breakdown, compile_cache, host_batch
from laminar_jax.runtime import engine_metrics
from rollout.rpc import call, send
# rl_step and checkpoint (jax, flax, orbax) are imported in the actor's __init__: the driver
# imports this module only for the class, and skipping them there saves it seconds of start-up

STALL_TIMEOUT_S = 900.0
# close() waits this long for the background precompile, so a short run leaves every bucket in
# the persistent compile cache (killed mid-compile, the next run compiled the same buckets again)
PRECOMPILE_JOIN_S = 120.0
# the buckets after the first compile at this nice value: they yield the cores to the rollouts'
# first batch (the first step needs the smallest bucket only, in all likelihood)
PRECOMPILE_NICE = 10
# one blocking wait on the data actor; the learner re-asks until STALL_TIMEOUT_S
SAMPLE_WAIT_S = 5.0
# while it waits for the data actor, a step looks this often whether close() began
CLOSE_POLL_S = 0.1
# close() waits this long for a step in flight to end (an update, with its compiles) before closing
CLOSE_WAIT_S = 240.0


class LearnerClosed(RuntimeError):
    """close() began while this step ran (the driver stopped with a step in flight): the step
    ends before it publishes or saves, so nothing is handed to a closed orbax checkpointer."""


def _lower_thread_priority() -> None:
    """Lowers the calling thread's CPU priority (Linux: nice is per thread) to PRECOMPILE_NICE,
    never raising it (a learner started under a higher nice keeps it)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), PRECOMPILE_NICE))
    except (OSError, AttributeError):   # not Linux, or not allowed: the compile runs at full priority
        pass


class Learner:
    """Holds the train state; `step()` runs one iteration and returns its log records."""

    def __init__(self, cfg: Any, run_dir: str, data: Any, *, resume: bool = True, min_update_s: float = 0.0,
                 store_root: str | None = None, host: tuple | None = None, followers: list | None = None,
                 max_row_tokens: int | None = None, publisher: Any = None):
        """data: the data actor, or the `DataActor` itself in this process (run.colocate).
        publisher: where versions go instead of a weight store (run.colocate: the rollout's
        `InProcessWeights`); None: the weight store `store_root` names."""
        clock = breakdown.InitClock()   # the `learner_init` event: wall and CPU s per phase
        import jax

        from laminar_jax.runtime import learner_group
        # host = (process id, learner.hosts, coordinator): one process of a multi-host learner,
        # joined before any JAX computation; the leader (0) mirrors its collective calls to followers
        if host is not None:
            from laminar_jax.learner.distributed import initialize
            initialize(host[2], num_processes=host[1], process_id=host[0])
        self.process, self.hosts = (0, 1) if host is None else (host[0], host[1])
        self._mirror, self._follower = learner_group.Mirror(followers), learner_group.Follower()

        from laminar_jax import sharding as shd
        from laminar_jax.learner.setup import build
        from laminar_jax.runtime import rl_step
        from laminar_jax.runtime.checkpoint import Checkpointer, checkpoint_due
        from laminar_jax.weights.publish import Publisher, WeightStore

        from laminar_jax.learner import distributed
        self.cfg, self.data, self._jax, self._shd, self._dist = cfg, data, jax, shd, distributed
        self._rl_step, self._checkpoint_due = rl_step, checkpoint_due
        compile_cache.enable(cfg.run.compile_cache)   # also when Ray was started without its env
        clock.mark("import")
        # benchmarks only: an update lasts at least this long (an accelerator-bound learner)
        self.min_update_s = float(min_update_s)
        self.mode = cfg.manager.mode
        self.group_size, self.global_batch = cfg.data.group_size, cfg.learner.global_batch_groups
        self.setup = build(cfg, total_steps=cfg.run.steps)
        rows = self.global_batch // cfg.learner.mini_batches * self.group_size
        # the engines' mismatch metrics: this version's log-probs from the train step's forward
        # where it covers the batch; the separate pass over the batch for the rest
        self._logp_from_step = engine_metrics.logp_from_train_step(cfg, rows)
        self.fns = rl_step.build(cfg, self.setup, mini_batch_rows=rows,
                                 batch_logp=engine_metrics.needs_batch_logp_pass(cfg, rows))
        clock.mark("build")
        self.state, self.version = self.setup.state, 0
        self._lock, self._events = threading.Lock(), []
        # The actor is threaded: close() may come while a step runs (the driver stopped on an
        # error or a hook with the next step queued). A step holds _step_lock; close() sets
        # _closing, then takes the lock, so it closes orbax only once no step can save any more.
        self._step_lock, self._closing = threading.Lock(), threading.Event()
        self._publish_t0, self._write_s = {}, 0.0
        self.checkpointer = Checkpointer(run_dir, on_commit=lambda rec: self._log_committed([rec]))
        latest = self.checkpointer.latest() if resume else None
        if latest is not None:
            self.state, meta = self.checkpointer.restore(latest, self.state)   # every host: its shards
            self.version = int(meta["version"])
            if self.process == 0:
                call(data.load_state_dict, meta["data"])
            self._event("resumed", version=self.version, checkpoint=latest)
        self._last_ckpt = (self.version, time.time())  # (version, time) of the last checkpoint
        clock.mark("restore")
        self.ref_params = (jax.tree.map(lambda x: x.copy(), self.state.params)
                           if self.fns.needs_ref else None)
        from laminar_jax.runtime.run_folder import clean_stale_stores
        for stale in (clean_stale_stores(cfg.relay.store_dir) if self.process == 0 else ()):  # crashed runs'
            self._event("stale_store_removed", path=stale)
        # store_root: chosen by the driver (`Fleet.start`), so relays and rollouts start before
        # this init ends; the default names the store after this process
        if publisher is None:
            root = store_root or os.path.join(cfg.relay.store_dir, f"{cfg.run.name}-{os.getpid()}")
            self.store = WeightStore.local(root)
            self.publisher = Publisher(self.store, dtype=cfg.model.rollout_dtype, events=self._event)
        else:
            self.store, self.publisher = None, publisher
        self._last_end = time.time()
        self.rejected_too_long = 0
        self._past_params: dict[int, Any] = {}   # version -> params (learner.mismatch_versions)
        self._precompile = None
        # every bucket's step compiles while the first rollouts generate; max_row_tokens (the
        # longest row the data can make, `batch.row_reach`) leaves out buckets no batch can need
        if cfg.learner.precompile:
            k = cfg.learner.mini_batches if modes.streams_minibatches(self.mode) else 1
            self._precompile = threading.Thread(
                target=rl_step.precompile_all, daemon=True, name="learner-precompile",
                args=(cfg, self.fns, jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)),
                kwargs=dict(num_groups=self.global_batch // k, events=self._event,
                            after_first=_lower_thread_priority, max_row_tokens=max_row_tokens))
            self._precompile.start()
        clock.mark("store")
        self._event("learner_init", **clock.phases)
        self._checkpoint_s = 0.0
        self._waiting_since: float | None = None   # the driver's liveness check reads it

    # ------------------------------------------------------------------ plumbing
    def _event(self, kind: str, **fields: Any) -> None:
        with self._lock:
            # the orbax write runs in the background: its duration, for the step breakdown
            if kind == "publish_start":
                self._publish_t0[fields["version"]] = time.perf_counter()
            elif kind == "publish_written" and fields.get("version") in self._publish_t0:
                fields["write_s"] = self._write_s = time.perf_counter() - self._publish_t0.pop(fields["version"])
                # superseded writes never finish: forget them
                self._publish_t0 = {v: t for v, t in self._publish_t0.items() if v > fields["version"]}
            self._events.append({"kind": kind, "t": time.time(), **fields})   # source time (chaos timings)

    def weight_store(self):
        return self.store

    def pid(self) -> int:
        """This process (the driver removes the weight store once it is gone)."""
        return os.getpid()

    def set_master(self, master: Any) -> None:
        self.publisher.set_master(master)

    def current_version(self) -> int:
        return self.version

    def waiting(self) -> float | None:
        """Seconds the current step has waited for groups so far; None while not waiting."""
        since = self._waiting_since
        return None if since is None else time.time() - since

    def publish(self) -> int:
        with self._step_lock:
            self._check_open()
            self._mirror.send(self.version, "publish")
            self.publisher.publish(self.version, self.state.params)
            self._mirror.collect()
            return self.version

    def _check_open(self) -> None:
        if self._closing.is_set():
            raise LearnerClosed(f"learner at version {self.version}: closing, the step ends here")

    def follow(self, seq: int, version: int, op: str, args: tuple) -> tuple | None:
        """A follower host: the leader's collective call number `seq`, run in the leader's order;
        an update returns (metrics, trajectory rows, TrajectoryStats) of this host's part."""
        out = {}

        def run():
            self.version = version
            if op == "update":   # (ticket, mini-batches): this host's part comes from the data actor
                self._times = breakdown.Stopwatch()
                ticket, mini_batches = args
                groups = ray.get(self.data.host_part.remote(ticket, self.process), timeout=SAMPLE_WAIT_S + 60)
                out["update"] = self._update(groups, mini_batches)
            elif op == "publish":
                self.publisher.publish(version, self.state.params)
            elif op == "save":
                self.checkpointer.save(version, self.state, args[0])
            elif op == "close":
                self.checkpointer.close()
                self.publisher.close()
            else:
                raise ValueError(f"learner host {self.process}: unknown mirrored call {op!r}")
        self._follower.run(seq, run)
        with self._lock:   # the leader reports the step's events; a follower's would only pile up
            self._events.clear()
        return out.get("update")

    def num_params(self) -> int:
        return self.setup.sharded.num_params()

    # ------------------------------------------------------------------ one iteration
    def _collect(self, num_groups: int) -> tuple[list, Any, float]:
        """Wait for `num_groups` whole groups; returns this host's part of them, the ticket the
        other learner hosts take theirs with (None: one host) and the seconds spent waiting."""
        start = self._waiting_since = time.time()
        batch_index = self.version if modes.uses_global_batches(self.mode) else None
        while True:
            if not hasattr(self.data.wait_sample, "remote"):   # the data actor in this process
                groups = self.data.wait_sample(num_groups, self.version, batch_index, CLOSE_POLL_S)
                self._check_open()
                if groups:
                    self._waiting_since = None
                    return groups, None, time.time() - start
                self._check_stalled(num_groups, start)
                continue
            # blocks in the data actor until the groups are there; here, close() is looked for
            if self.hosts > 1:
                ref = self.data.wait_sample_hosts.remote(num_groups, self.version, batch_index,
                                                         SAMPLE_WAIT_S, self.hosts)
            else:
                ref = self.data.wait_sample.remote(num_groups, self.version, batch_index, SAMPLE_WAIT_S)
            deadline = time.monotonic() + SAMPLE_WAIT_S + 60
            while not ray.wait([ref], timeout=CLOSE_POLL_S)[0]:
                self._check_open()
                if time.monotonic() > deadline:
                    raise ray.exceptions.GetTimeoutError(
                        f"learner: data.wait_sample gave no answer within {SAMPLE_WAIT_S + 60:.0f} s")
            got = ray.get(ref)
            if self.hosts > 1:
                ticket, groups = got if got is not None else (None, [])
            else:
                ticket, groups = None, got
            if groups:
                self._waiting_since = None
                return groups, ticket, time.time() - start
            self._check_stalled(num_groups, start)

    def _check_stalled(self, num_groups: int, start: float) -> None:
        if time.time() - start > STALL_TIMEOUT_S:
            raise RuntimeError(f"learner: no {num_groups} groups for version {self.version} after "
                               f"{STALL_TIMEOUT_S:.0f} s; rollouts dead or stalled "
                               f"(accounting {call(self.data.accounting, timeout=60)})")

    def _update(self, groups: list, mini_batches: int) -> tuple[dict, list[dict], list]:
        """One update on this host's groups (all of them with one host); returns its metrics,
        trajectory log rows and `batch.TrajectoryStats`."""
        from laminar_jax.learner.train_step import NonFiniteLossError

        clock = time.perf_counter()
        logp_compiled = self.fns.logprobs.aot.call_compiles
        lc = self.cfg.learner
        rows = len(groups) * self.group_size
        groups, rejected = B.reject_too_long(groups, lc.max_seq_len)
        if rejected:  # counted and reported, never cut
            self.rejected_too_long += rejected
            self._event("rejected_too_long", version=self.version, count=rejected, max_seq_len=lc.max_seq_len)
        min_len = min(lc.min_bucket, lc.max_seq_len)
        # learner.hosts > 1: the hosts agree on the row length and number their groups globally
        plan = host_batch.plan(groups, max_seq_len=lc.max_seq_len, min_len=min_len)
        batch = B.assemble(groups, learner_version=self.version, max_seq_len=lc.max_seq_len,
                           min_len=min_len, rows=rows, length=plan.length)
        batch["advantages"], metrics = host_batch.advantages(self.fns.advantages, batch, plan)
        clock = self._times.add("batch_s", clock)
        # the learner's log-probs at this version: the engines' mismatch metrics, and prox_logp
        # when the anchor is this version's weights (packing carries it into the rows); taken
        # from the train step's forward instead where it covers the batch (engine_metrics)
        from_step = self._logp_from_step and mini_batches == 1
        learner_logp = None if from_step else self.fns.logprobs(self.state.params, batch)
        stale = set(np.unique(batch["staleness"][batch["response_mask"] > 0]).astype(int).tolist())
        past = list(self._past_params.items())   # only versions with tokens (on any host)
        need = host_batch.any_host([self.version - v in stale for v, _ in past])
        past_logp = {self.version - v: self.fns.logprobs(p, batch) for (v, p), n in zip(past, need) if n}
        self._keep_params_for_mismatch()
        if self.fns.needs_prox and not self.cfg.loss.needs_ewma:
            batch["prox_logp"] = learner_logp
        mbs = host_batch.layout(batch, mini_batches, pack_rows=lc.pack, max_seq_len=lc.max_seq_len,
                                row_multiple=self.fns.row_multiple)
        for mb in mbs:  # before any update: prox/ref log-probs are of this version's params
            if self.fns.needs_prox and "prox_logp" not in mb:
                mb["prox_logp"] = self.fns.logprobs(self.fns.prox_params(self.state), mb)
            if self.fns.needs_ref:
                mb["ref_logp"] = self.fns.logprobs(self.ref_params, mb)
        clock = self._times.add("logprob_s", clock)
        metrics.update({"learner/rejected_too_long": float(self.rejected_too_long),
                        "learner/token_fill": float(np.mean([(mb["segment_ids"] > 0).mean() for mb in mbs])),
                        "learner/rows": float(mbs[0]["tokens"].shape[0]),
                        "learner/row_len": float(mbs[0]["tokens"].shape[1])})
        steps, compiled = [], self.fns.train.call_compiles
        for mb in mbs:
            # each host puts its own rows (learner.distributed; one host: shard_batch)
            inputs = self._dist.global_arrays(self.fns.inputs(self.state.params, mb), self.setup.mesh)
            try:
                self.state, m = self.fns.train(self.state, inputs)
            except NonFiniteLossError as e:
                self.state, m = e.state, e.metrics
                self._event("nonfinite_loss", version=self.version, loss=m.get("loss"))
            steps.append(self._rl_step.scalar_metrics(m, "loss/"))   # float(): waits for the update
        clock = self._times.add("update_s", clock)
        if from_step and lc.pack:   # one mini-batch, packed (one host): back in the batch's rows
            learner_logp = B.unpack(np.asarray(self._dist.to_host(m[self._rl_step.TOKEN_LOGP]), np.float32), batch,
                                    max_seq_len=lc.max_seq_len)
        elif from_step:   # one mini-batch, unpacked: its rows are the batch's
            learner_logp = host_batch.local_rows(self._dist.to_host(m[self._rl_step.TOKEN_LOGP]),
                                                 batch["tokens"].shape[0]).astype(np.float32)
        mismatch_logp, measured = engine_metrics.at_token_versions(batch["staleness"], {0: learner_logp, **past_logp})
        metrics.update(engine_metrics.step_metrics(self.cfg, batch, mismatch_logp,
                                                   [t.rollout_id for g in groups for t in g], measured))
        self._times.add("batch_s", clock)
        # train-step shapes compiled inside this update (0 once learner.precompile covered them)
        metrics["learner/step_compiles"] = float(self.fns.train.call_compiles - compiled)
        # log-prob passes compiled inside this update, the batch's own included (its first use of
        # a bucket sits on the critical path: 0 once learner.precompile covered them)
        metrics["learner/logprob_compiles"] = float(self.fns.logprobs.aot.call_compiles - logp_compiled)
        for key in steps[0]:
            metrics[key] = float(np.mean([s[key] for s in steps]))
        table = engine_metrics.labels(self.cfg)
        return metrics, [dict(t.log_row(self.version), learner_version=self.version,
                              trajectory_id=f"{t.group_id}/{t.sample_index}",
                              **engine_metrics.row_labels(self.cfg, t.rollout_id, table)) for g in groups for t in g], \
            [B.TrajectoryStats.of(t) for g in groups for t in g]

    def _keep_params_for_mismatch(self) -> None:
        """learner.mismatch_versions: a copy of this version's params (the update donates them)."""
        keep = self.cfg.learner.mismatch_versions
        if keep:
            self._past_params[self.version] = self._jax.tree.map(lambda x: x.copy(), self.state.params)
            for v in [v for v in self._past_params if v <= self.version - keep]:
                del self._past_params[v]

    def step(self, checkpoint_first: bool = False) -> dict | None:
        """One iteration; returns {"metrics", "trajectories", "events", "version",
        "checkpoint_due"}, or None when close() began before it could publish (nobody reads that
        step: the driver is stopping, and an error there would only be logged as an unhandled one).

        checkpoint_first: first save the checkpoint the previous step said was due. The driver
        asks for it once that step's rows are on disk, so a committed checkpoint never covers a
        step whose rows a crash of the driver could still lose."""
        with self._step_lock:
            try:
                self._check_open()
                clock = time.perf_counter()
                if checkpoint_first:
                    self.checkpoint()
                self._checkpoint_s = time.perf_counter() - clock   # this step's breakdown carries it
                return self._step()
            except LearnerClosed:
                return None
            except Exception as e:
                self._mirror.explain(e)   # learner.hosts > 1: a dead host's name, not a gloo error
                raise

    def _step(self) -> dict:
        t_start, v = time.time(), self.version
        self._times = breakdown.Stopwatch()
        k = self.cfg.learner.mini_batches
        parts = [(self.global_batch // k, 1)] * k if modes.streams_minibatches(self.mode) \
            else [(self.global_batch, k)]
        metrics_parts, rows, waited, consumed = [], [], 0.0, []
        for num_groups, mini_batches in parts:
            groups, ticket, w = self._collect(num_groups)
            waited += w
            # the other hosts: the same update, each on its own part of the batch (the ticket's)
            self._mirror.send(v, "update", ticket, mini_batches)
            m, r, c = self._update(groups, mini_batches)
            metrics_parts.append(m)
            rows += r
            consumed += c
        short = self.min_update_s - (time.time() - t_start - waited)
        if short > 0:   # benchmarks: the emulated accelerator-bound update is update time
            time.sleep(short)
            self._times.times["update_s"] += short
        # the last point the step may end: past it, it publishes (and may save) this version;
        # every host has run the same updates, none a publish the others lack
        self._check_open()
        self.version = v + 1
        clock = time.perf_counter()
        self._mirror.send(self.version, "publish")
        self.publisher.publish(self.version, self.state.params)
        self._times.add("publish_s", clock)
        send(self.data.set_learner_version, self.version)
        end = time.time()
        checkpoint_s = self._checkpoint_s   # the save this step began with (checkpoint_first)
        run = self.cfg.run
        due = self._checkpoint_due(self.version, last_version=self._last_ckpt[0], last_time=self._last_ckpt[1],
                                   now=time.time(), every=run.checkpoint_every, every_s=run.checkpoint_every_s,
                                   final_version=run.steps)
        # the other hosts' parts of this step (a failure: LearnerHostError): their updates'
        # metrics (averaged with the leader's), trajectory rows and stats
        for m, r, c in (out for out in self._mirror.collect() if out is not None):
            metrics_parts.append(m)
            rows += r
            consumed += c
        metrics = {key: float(np.mean([m[key] for m in metrics_parts])) for key in metrics_parts[0]}
        wall = max(end - self._last_end, 1e-9)
        tokens = sum(t.num_tokens for t in consumed)
        rewards = [t.reward for t in consumed]
        metrics.update(B.staleness_stats([consumed], v))
        metrics.update(tool_step_metrics([t.turn_stats for t in consumed],   # fixed keys, 0 single-turn
                                         [t.num_tokens for t in consumed]))
        metrics.update(version=self.version, reward_mean=float(np.mean(rewards)), exact_rate=exact_rate(rewards),
                       reward_std=float(np.std(rewards)), response_len_mean=tokens / len(rewards),
                       consumed_trajectories=len(rewards), consumed_tokens=tokens,
                       learner_wait_s=waited, learner_update_s=end - t_start - waited, step_wall_s=wall,
                       learner_idle_frac=min(1.0, (waited + t_start - self._last_end) / wall),
                       trajectories_per_s=len(rewards) / wall, tokens_per_s=tokens / wall)
        self._times.times["wait_data_s"] = waited
        metrics.update(self._times.learner_step(wall=wall, gap=t_start - self._last_end,
                                                checkpoint=checkpoint_s))
        metrics["time/publish_write_s"] = self._write_s   # background (newest finished write)
        metrics["learner/hosts"] = float(self._jax.process_count())   # learner.hosts joined in its mesh
        self._last_end = end
        with self._lock:
            events, self._events = self._events, []
        # checkpoint_due: the driver writes this step's rows, then asks for the save
        # (step(checkpoint_first=True), or save_checkpoint() after the last step)
        return {"metrics": metrics, "trajectories": rows, "events": events, "version": self.version,
                "checkpoint_due": due}

    def save_checkpoint(self) -> int:
        """Saves the current version (the last step's due checkpoint); returns the version."""
        with self._step_lock:
            self._check_open()
            self.checkpoint()
            self._mirror.collect()
            return self.version

    def checkpoint(self) -> int:
        meta = {"version": self.version, "data": call(self.data.state_dict, timeout=300)}
        self._mirror.send(self.version, "save", meta)
        self.checkpointer.save(self.version, self.state, meta)
        self._last_ckpt = (self.version, time.time())
        return self.version

    def _log_committed(self, saves: list[dict]) -> None:
        for rec in saves:
            self._event("checkpoint", version=rec["version"], path=rec["path"], save_s=rec["save_s"])

    def close(self) -> list[dict]:
        """Ends the step in flight (at its next wait for data, or before its publish), then
        waits for orbax's writes and saves and closes them, and removes the weight store."""
        import shutil
        self._closing.set()
        if not self._step_lock.acquire(timeout=CLOSE_WAIT_S):   # an update still compiling
            self._event("close_timeout", version=self.version, waited_s=CLOSE_WAIT_S)
            return self._drain_events()
        try:
            return self._close(shutil)
        finally:
            self._step_lock.release()

    def _drain_events(self) -> list[dict]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def _close(self, shutil: Any) -> list[dict]:
        if not self._mirror.alive():   # a dead learner host: no multi-host save or write can finish
            self._remove_store(shutil)
            return [{"kind": "learner_host_lost", "t": time.time(), "version": self.version}]
        if self._precompile is not None:   # finish filling the compile cache (PRECOMPILE_JOIN_S)
            self._precompile.join(PRECOMPILE_JOIN_S)
        self._mirror.send(self.version, "close")
        self._log_committed(self.checkpointer.close())
        self.publisher.close()
        self._mirror.collect()
        self._remove_store(shutil)
        return self._drain_events()

    def _remove_store(self, shutil: Any) -> None:
        if self.store is not None:   # run.colocate: versions stayed in memory
            shutil.rmtree(self.store.root, ignore_errors=True)
