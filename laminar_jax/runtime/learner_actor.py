"""The learner actor: sample whole groups, update, version += 1, publish without waiting.

One `step()` is one RL iteration (paper section 4: a version is one global batch):

    groups   <- data.sample(...)              FIFO, or one global batch (global-batch modes);
                                              mini-batch by mini-batch as they finish (stream)
    batch    <- assemble(groups)              fixed shapes per length bucket
    A        <- advantages (per group)        prox_logp / ref_logp when the loss needs them
    K x      state <- train(state, mini-batch)
    version += 1; publisher.publish(version, params)     returns after the device-to-host copy
    checkpoint every run.checkpoint_every versions (orbax, async)
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import ray

from laminar_jax.manager import modes
from laminar_jax.runtime import batch as B
from laminar_jax.runtime import rl_step
from laminar_jax.runtime.checkpoint import Checkpointer

STALL_TIMEOUT_S = 900.0


class Learner:
    """Holds the train state; `step()` runs one iteration and returns its log records."""

    def __init__(self, cfg: Any, run_dir: str, data: Any, *, resume: bool = True, min_update_s: float = 0.0):
        import jax

        from laminar_jax import sharding as shd
        from laminar_jax.learner.setup import build
        from laminar_jax.weights.publish import Publisher, WeightStore

        self.cfg, self.data, self._jax, self._shd = cfg, data, jax, shd
        # benchmarks only: an update lasts at least this long (an accelerator-bound learner)
        self.min_update_s = float(min_update_s)
        self.mode = cfg.manager.mode
        self.group_size, self.global_batch = cfg.data.group_size, cfg.learner.global_batch_groups
        self.setup = build(cfg, total_steps=cfg.run.steps)
        rows = self.global_batch // cfg.learner.mini_batches * self.group_size
        self.fns = rl_step.build(cfg, self.setup, mini_batch_rows=rows)
        self.state, self.version = self.setup.state, 0
        self._lock, self._events = threading.Lock(), []
        self.checkpointer = Checkpointer(run_dir)
        latest = self.checkpointer.latest() if resume else None
        if latest is not None:
            self.state, meta = self.checkpointer.restore(latest, self.state)
            self.version = int(meta["version"])
            ray.get(data.load_state_dict.remote(meta["data"]))
            self._event("resumed", version=self.version, checkpoint=latest)
        self.ref_params = (jax.tree.map(lambda x: x.copy(), self.state.params)
                           if self.fns.needs_ref else None)
        root = os.path.join(cfg.relay.store_dir, f"{cfg.run.name}-{os.getpid()}")
        self.store = WeightStore.local(root)
        self.publisher = Publisher(self.store, dtype=cfg.model.rollout_dtype, events=self._event)
        self._last_end = time.time()
        self._waiting_since: float | None = None   # the driver's liveness check reads it

    # ------------------------------------------------------------------ plumbing
    def _event(self, kind: str, **fields: Any) -> None:
        with self._lock:
            self._events.append({"kind": kind, "t": time.time(), **fields})   # source time (chaos timings)

    def weight_store(self):
        return self.store

    def set_master(self, master: Any) -> None:
        self.publisher.set_master(master)

    def current_version(self) -> int:
        return self.version

    def waiting(self) -> float | None:
        """Seconds the current step has waited for groups so far; None while not waiting."""
        since = self._waiting_since
        return None if since is None else time.time() - since

    def publish(self) -> int:
        self.publisher.publish(self.version, self.state.params)
        return self.version

    def num_params(self) -> int:
        return self.setup.sharded.num_params()

    # ------------------------------------------------------------------ one iteration
    def _collect(self, num_groups: int) -> tuple[list, float]:
        """Wait for `num_groups` whole groups; returns them and the seconds spent waiting."""
        start = self._waiting_since = time.time()
        batch_index = self.version if modes.uses_global_batches(self.mode) else None
        while True:
            groups = ray.get(self.data.sample.remote(num_groups, self.version, batch_index), timeout=300)
            if groups:
                self._waiting_since = None
                return groups, time.time() - start
            if time.time() - start > STALL_TIMEOUT_S:
                raise RuntimeError(f"learner: no {num_groups} groups for version {self.version} after "
                                   f"{STALL_TIMEOUT_S:.0f} s; rollouts dead or stalled "
                                   f"(accounting {ray.get(self.data.accounting.remote())})")
            time.sleep(0.02)

    def _update(self, groups: list, mini_batches: int) -> tuple[dict, list[dict]]:
        from laminar_jax.learner.train_step import NonFiniteLossError

        max_len = self.cfg.learner.max_seq_len
        batch = B.assemble(groups, learner_version=self.version, max_seq_len=max_len, min_len=min(64, max_len))
        batch["advantages"], metrics = self.fns.advantages(batch, len(groups))
        if self.fns.needs_prox:
            batch["prox_logp"] = self.fns.logprobs(self.state.params, batch)
        if self.fns.needs_ref:
            batch["ref_logp"] = self.fns.logprobs(self.ref_params, batch)
        steps = []
        for mb in B.split(batch, mini_batches):
            inputs = self._shd.shard_batch(rl_step.train_inputs(self.cfg, mb), self.setup.mesh)
            try:
                self.state, m = self.fns.train(self.state, inputs)
            except NonFiniteLossError as e:
                self.state, m = e.state, e.metrics
                self._event("nonfinite_loss", version=self.version, loss=m.get("loss"))
            steps.append(rl_step.scalar_metrics(m, "loss/"))
        for key in steps[0]:
            metrics[key] = float(np.mean([s[key] for s in steps]))
        return metrics, [dict(t.log_row(self.version), learner_version=self.version) for g in groups for t in g]

    def step(self) -> dict:
        """One iteration; returns {"metrics", "trajectories", "events", "version"}."""
        t_start, v = time.time(), self.version
        k = self.cfg.learner.mini_batches
        parts = [(self.global_batch // k, 1)] * k if modes.streams_minibatches(self.mode) \
            else [(self.global_batch, k)]
        metrics_parts, rows, waited, groups_all = [], [], 0.0, []
        for num_groups, mini_batches in parts:
            groups, w = self._collect(num_groups)
            waited += w
            groups_all += groups
            m, r = self._update(groups, mini_batches)
            metrics_parts.append(m)
            rows += r
        metrics = {key: float(np.mean([m[key] for m in metrics_parts])) for key in metrics_parts[0]}
        short = self.min_update_s - (time.time() - t_start - waited)
        if short > 0:
            time.sleep(short)
        self.version = v + 1
        self.publisher.publish(self.version, self.state.params)
        self.data.set_learner_version.remote(self.version)
        end = time.time()
        wall = max(end - self._last_end, 1e-9)
        tokens = sum(t.num_tokens for g in groups_all for t in g)
        rewards = [t.reward for g in groups_all for t in g]
        metrics.update(B.staleness_stats(groups_all, v))
        metrics.update(version=self.version, reward_mean=float(np.mean(rewards)),
                       reward_std=float(np.std(rewards)), response_len_mean=tokens / len(rewards),
                       consumed_trajectories=len(rewards), consumed_tokens=tokens,
                       learner_wait_s=waited, learner_update_s=end - t_start - waited, step_wall_s=wall,
                       learner_idle_frac=min(1.0, (waited + t_start - self._last_end) / wall),
                       trajectories_per_s=len(rewards) / wall, tokens_per_s=tokens / wall)
        self._last_end = end
        every = self.cfg.run.checkpoint_every
        if (every and self.version % every == 0) or self.version >= self.cfg.run.steps:
            self.checkpoint()
        with self._lock:
            events, self._events = self._events, []
        return {"metrics": metrics, "trajectories": rows, "events": events, "version": self.version}

    def checkpoint(self) -> int:
        meta = {"version": self.version, "data": ray.get(self.data.state_dict.remote())}
        self.checkpointer.save(self.version, self.state, meta)
        self._event("checkpoint", version=self.version, path=self.checkpointer.directory)
        return self.version

    def close(self) -> list[dict]:
        import shutil
        self.checkpointer.close()
        self.publisher.close()
        shutil.rmtree(self.store.root, ignore_errors=True)
        with self._lock:
            events, self._events = self._events, []
        return events
