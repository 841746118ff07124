"""Starting and stopping the actors of one run (DESIGN.md, "Processes"): data, learner, relays,
rollouts, manager. `Fleet.start(cfg, run_dir, model_dir)` returns the handles; the driver runs the
loop. Every actor takes 0 logical CPUs.

Rollouts come pool by pool (`cfg.rollout.assignments()`: the short form is one pool); each runs
with its pool's short-form config (`RolloutConfig.for_pool`) and engine. Rollouts without
accelerators are spread over the nodes (one relay per node); a rollout asking for accelerators
is placed by Ray on their resources (`num_gpus`; more than one: a one-bundle placement group),
and reads from the relay of whatever node it lands on. A vLLM rollout gets a tmpfs folder for
its config.json (removed at `stop`) and, on a CPU host, one OpenMP thread (rollout.vllm_engine)."""
from __future__ import annotations

import dataclasses
import os
import shutil
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
from laminar_jax.runtime.data_actor import CONCURRENCY_GROUPS, DataActor
from laminar_jax.runtime.learner_actor import Learner
from laminar_jax.runtime.weights_source import RelaySource, StoreSource
from rollout.worker import RolloutWorker

# learner init and the first publish (compiles included) on a loaded machine
STARTUP_TIMEOUT_S = 600.0


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
    relay_events: list = field(default_factory=list)   # the relays' records of the last drain
    workdirs: list = field(default_factory=list)
    placement_groups: list = field(default_factory=list)

    @classmethod
    def start(cls, cfg: Any, run_dir: str, model_dir: str | None, *, events=None,
              latency_model: Any = None, resume: bool = True, min_update_s: float = 0.0,
              on_phase: Any = None) -> "Fleet":
        """Start-up order (DESIGN.md "Processes"): the data and learner actors are created first
        and the learner initialises while the relays and, with relays on, the rollouts start
        (their engines are built on the first weights they pull). on_phase(key, text) is told each
        phase as it ends (key: the summary's `startup` entry, text: the start-up line)."""
        engines.check_engines(cfg, model_dir)
        phase = on_phase or (lambda key, text: None)
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
        data = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(DataActor).options(num_cpus=0, max_concurrency=1).remote(
            pool_kw, buffer_kw, mode=cfg.manager.mode,
            global_batch=cfg.learner.global_batch_groups, max_staleness=cfg.manager.max_staleness)
        nodes = cluster.alive_nodes()
        learner = ray.remote(Learner).options(**cluster.actor_options(
            kind, need["learner"], devices=learner_devices, node=nodes[0], max_concurrency=4)).remote(
            cfg, run_dir, data, resume=resume, min_update_s=min_update_s)
        phase("actors", "learner and data actors created; learner initialising (jax, model, optimizer)")
        mcfg = engines.model_config(cfg, model_dir)
        relays, prefix = None, f"laminar-relay-{cfg.run.name}-{uuid.uuid4().hex[:6]}"
        workers, loops, workdirs, pgs = {}, {}, [], []

        def start_rollouts(store):
            for i, (rid, pool) in enumerate(cfg.rollout.assignments()):
                source = RelaySource(prefix) if store is None else StoreSource(store, mcfg)
                rcfg = dataclasses.replace(cfg, rollout=cfg.rollout.for_pool(pool))
                accel = need["rollout"][rid] if kind else 0.0
                workdir, env = None, {}
                if pool.engine == "vllm":
                    workdir = os.path.join(cfg.relay.store_dir, f"vllm-{prefix}-{rid}")
                    workdirs.append(workdir)
                    if kind is None:
                        env["OMP_NUM_THREADS"] = "1"
                factory = engines.EngineFactory(rcfg, model_dir, seed=cfg.run.seed * 1000 + i,
                                                latency_model=latency_model, workdir=workdir,
                                                accelerators=accel, kind=kind)
                pg = cluster.placement_group_for(kind, accel, f"{prefix}-{rid}") if kind and accel > 1 else None
                pgs.extend([pg] if pg is not None else [])
                opts = cluster.actor_options(kind, accel, node=None if accel else nodes[i % len(nodes)],
                                             max_concurrency=8, placement_group=pg, env=env)
                workers[rid] = ray.remote(RolloutWorker).options(**opts).remote(
                    rid, rcfg, data, source, factory, tokenizer, RewardScorer(reward))
                loops[rid] = workers[rid].run.remote()
                if events is not None:
                    events("rollout_started", rollout=rid, pool=pool.name, engine=pool.engine, accelerators=accel,
                           **engines.vllm_kwargs(accel, kind) if pool.engine == "vllm" else {})

        if cfg.relay.enabled:   # rollouts wait on their relay: they can start before the learner is up
            start_rollouts(None)
            phase("rollouts", f"{cfg.rollout.num_rollouts} rollouts starting (they wait for the first weights)")
        store = ray.get(learner.weight_store.remote(), timeout=STARTUP_TIMEOUT_S)
        phase("learner", "learner ready")
        if cfg.relay.enabled:
            from laminar_jax.weights.relay_group import RelayGroup
            relays = RelayGroup(mcfg, store, nodes=nodes, num_chunks=cfg.relay.num_chunks or None,
                                t_byte=cfg.relay.t_byte_s, t_start=cfg.relay.t_start_s, prefix=prefix,
                                transport=cfg.relay.transport, stream_timeout_s=cfg.relay.stream_timeout_s,
                                shared_memory=cfg.relay.shared_memory,
                                on_master_change=[lambda m: ray.get(learner.set_master.remote(m))],
                                events=events, runtime_env={"env_vars": {
                                    "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}})
            phase("relays", f"{len(nodes)} relay(s) up")
        ray.get(learner.publish.remote(), timeout=STARTUP_TIMEOUT_S)
        phase("publish", "first weights published; rollouts building engines")
        if not cfg.relay.enabled:
            start_rollouts(store)
        manager = ray.remote(RolloutManager).options(num_cpus=0, max_concurrency=4).remote(cfg, workers, data)
        fleet = cls(data, learner, manager, workers, loops, relays, bad_rows=list(dataset.bad_rows),
                    workdirs=workdirs, placement_groups=pgs)
        fleet.manager_loop = manager.run.remote()
        return fleet

    def live_stats(self) -> list[dict]:
        """Stats of the rollouts the manager still counts as live."""
        live = ray.get(self.manager.report.remote())["live"]
        out = []
        for rid in live:
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
            self.relay_events = self.relays.collect_events()   # already logged; kept for the breakdown
        return recs

    def stop(self) -> list[dict]:
        """Stops loops and actors; returns the last events."""
        ray.get(self.manager.stop.remote())
        ray.get(self.manager_loop)
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
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # a dead learner: its weight store is removed by run_folder.clean_stale_stores
        if self.relays is not None:
            self.relays.shutdown()
        for handle in [self.learner, self.manager, self.data, *self.workers.values()]:
            ray.kill(handle, no_restart=True)
        for pg in self.placement_groups:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(pg)
        for d in self.workdirs:  # config.json of a vLLM rollout (on this host)
            shutil.rmtree(d, ignore_errors=True)
        return events
