"""Starting and stopping the actors of one run (DESIGN.md, "Processes"): data, learner, relays,
rollouts, manager. `Fleet.start(cfg, run_dir, model_dir)` returns the handles; the driver runs the
loop. Every actor takes 0 logical CPUs; rollouts are spread over the nodes (one relay per node).
The manager replaces dead rollouts through `RolloutSpawner`, so `workers` is refreshed from it."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from laminar_jax.data.datasets import load_dataset
from laminar_jax.data.factory import buffer_kwargs, prompt_pool_kwargs
from laminar_jax.data.prompt_pool import PromptEncoder
from laminar_jax.manager.manager import RolloutManager
from laminar_jax.rewards.registry import RewardScorer, resolve_reward
from laminar_jax.runtime import cluster, engines
from laminar_jax.runtime.data_actor import DataActor
from laminar_jax.runtime.learner_actor import Learner
from laminar_jax.runtime.weights_source import RelaySource, StoreSource
from rollout.worker import RolloutWorker


@dataclass
class RolloutSpawner:
    """Creates rollout `index` (restart 0 at start, then 1, 2, ... for its replacements): what the
    manager calls to replace a dead rollout. Picklable: it travels to the manager actor."""

    cfg: Any
    data: Any
    source: Any
    model_dir: str | None
    tokenizer: Any
    scorer: Any
    kind: str | None
    accelerators: float
    nodes: list
    latency_model: Any = None

    def __call__(self, index: int, restart: int = 0) -> tuple[str, Any]:
        rid = f"rollout-{index}" if restart == 0 else f"rollout-{index}.r{restart}"
        factory = engines.EngineFactory(self.cfg, self.model_dir, seed=self.cfg.run.seed * 1000 + index + 7919 * restart,
                                        latency_model=self.latency_model)
        opts = cluster.actor_options(self.kind, self.accelerators, node=self.nodes[index % len(self.nodes)],
                                     max_concurrency=8)
        handle = ray.remote(RolloutWorker).options(**opts).remote(
            rid, self.cfg, self.data, self.source, factory, self.tokenizer, self.scorer)
        return rid, handle


@dataclass
class Fleet:
    data: Any
    learner: Any
    manager: Any
    workers: dict[str, Any]
    loops: dict[str, Any]
    relays: Any = None
    manager_loop: Any = None
    bad_rows: list = field(default_factory=list)

    @classmethod
    def start(cls, cfg: Any, run_dir: str, model_dir: str | None, *, events=None,
              latency_model: Any = None, resume: bool = True, min_update_s: float = 0.0) -> "Fleet":
        mesh = cfg.mesh
        learner_devices = max(1, mesh.data) * mesh.fsdp * mesh.tensor
        kind = cluster.accelerator_kind()
        need = cluster.check_resources(cfg, learner_devices)
        reward = resolve_reward(cfg.reward, answer_field=cfg.data.answer_field)
        tokenizer = engines.tokenizer_for(model_dir)
        dataset = load_dataset(cfg.data, seed=cfg.run.seed)
        pool_kw = prompt_pool_kwargs(cfg.data, seed=cfg.run.seed, dataset=dataset,
                                     encode=PromptEncoder(tokenizer, chat_template=cfg.data.chat_template))
        buffer_kw = buffer_kwargs(cfg.data, seed=cfg.run.seed)
        # the learner takes a whole global batch at once: a smaller buffer could never hold one
        buffer_kw["capacity_groups"] = max(buffer_kw["capacity_groups"], cfg.learner.global_batch_groups)
        data = ray.remote(DataActor).options(num_cpus=0, max_concurrency=1).remote(
            pool_kw, buffer_kw, mode=cfg.manager.mode,
            global_batch=cfg.learner.global_batch_groups, max_staleness=cfg.manager.max_staleness)
        nodes = cluster.alive_nodes()
        learner = ray.remote(Learner).options(**cluster.actor_options(
            kind, need["learner"], devices=learner_devices, node=nodes[0], max_concurrency=4)).remote(
            cfg, run_dir, data, resume=resume, min_update_s=min_update_s)
        store = ray.get(learner.weight_store.remote())
        mcfg = engines.model_config(cfg, model_dir)
        relays, prefix = None, f"laminar-relay-{cfg.run.name}-{uuid.uuid4().hex[:6]}"
        if cfg.relay.enabled:
            from laminar_jax.weights.relay_group import RelayGroup
            r = cfg.relay
            relays = RelayGroup(mcfg, store, nodes=nodes, num_chunks=r.num_chunks or None,
                                t_byte=r.t_byte_s, t_start=r.t_start_s, prefix=prefix,
                                transport=r.transport, stream_timeout_s=r.stream_timeout_s,
                                shared_memory=r.shared_memory, idle_timeout_s=r.idle_timeout_s,
                                max_connections=r.max_connections, max_restarts=r.max_restarts,
                                on_master_change=[lambda m: ray.get(learner.set_master.remote(m), timeout=300)],
                                events=events, runtime_env={"env_vars": {
                                    "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}})
            relays.start_monitor(r.check_interval_s)
        ray.get(learner.publish.remote())
        # with relays, a rollout reads the store while its relay is dead or restarting
        source = (RelaySource(prefix, fallback=StoreSource(store, mcfg)) if relays is not None
                  else StoreSource(store, mcfg))
        spawn = RolloutSpawner(cfg, data, source, model_dir, tokenizer, RewardScorer(reward), kind,
                               need["rollout"], nodes, latency_model)
        workers, loops = {}, {}
        for i in range(cfg.rollout.num_rollouts):
            rid, workers[rid] = spawn(i)
            loops[rid] = workers[rid].run.remote()
        manager = ray.remote(RolloutManager).options(num_cpus=0, max_concurrency=4).remote(
            cfg, workers, data, spawn=spawn, loops=loops)
        fleet = cls(data, learner, manager, workers, loops, relays, bad_rows=list(dataset.bad_rows))
        fleet.manager_loop = manager.run.remote()
        return fleet

    def refresh(self) -> dict[str, Any]:
        """`workers` as the manager sees them now (dead ones gone, replacements in)."""
        try:
            self.workers = ray.get(self.manager.handles.remote(), timeout=300)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        return self.workers

    def live_stats(self) -> list[dict]:
        """Stats of the rollouts the manager still counts as live."""
        live = ray.get(self.manager.report.remote(), timeout=300)["live"]
        self.refresh()
        out = []
        for rid in [r for r in live if r in self.workers]:
            try:
                out.append(ray.get(self.workers[rid].stats.remote(), timeout=30))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
        return out

    def drain_events(self, *, check_relays: bool = True) -> list[dict]:
        recs = []
        for handle in list(self.workers.values()) + [self.manager]:
            try:
                recs += ray.get(handle.drain_events.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
        if self.relays is not None:
            if check_relays:
                self.relays.check()
            self.relays.collect_events()
        return recs

    def stop(self) -> list[dict]:
        """Stops loops and actors; returns the last events."""
        self.refresh()
        try:
            self.loops.update(ray.get(self.manager.loop_refs.remote(), timeout=60))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        try:
            ray.get(self.manager.stop.remote(), timeout=60)
            ray.get(self.manager_loop, timeout=120)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        for w in self.workers.values():
            try:
                w.stop.remote()
            except Exception:  # noqa: BLE001 - a killed rollout
                pass
        for rid, ref in self.loops.items():
            try:
                ray.get(ref, timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        events = self.drain_events()
        try:
            events += ray.get(self.learner.close.remote(), timeout=300)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):   # a killed learner
            pass
        if self.relays is not None:
            self.relays.shutdown()
        for handle in [self.learner, self.manager, self.data, *self.workers.values()]:
            ray.kill(handle, no_restart=True)
        return events
