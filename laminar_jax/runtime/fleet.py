"""Starting and stopping the actors of one run (DESIGN.md, "Processes"): data, learner, relays,
rollouts, manager. `Fleet.start(cfg, run_dir, model_dir)` returns the handles; the driver runs the
loop. Every actor takes 0 logical CPUs.

Rollouts come pool by pool (`cfg.rollout.assignments()`: the short form is one pool); each runs
with its pool's short-form config (`RolloutConfig.for_pool`) and engine. Rollouts without
accelerators are spread over the nodes (one relay per node); a rollout asking for accelerators
is placed by Ray on their resources (`num_gpus`; more than one: a one-bundle placement group),
and reads from the relay of whatever node it lands on. A vLLM rollout gets a tmpfs folder for
its config.json (removed at `stop`) and, on a CPU host, one OpenMP thread (rollout.vllm_engine).
The manager replaces dead rollouts through `RolloutSpawner`, so `workers` is refreshed from it."""
from __future__ import annotations

import dataclasses
import glob
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
from laminar_jax.runtime import cluster, engines, learner_group
from laminar_jax.runtime.batch import row_reach
from laminar_jax.runtime.data_actor import CONCURRENCY_GROUPS, DataActor
from laminar_jax.runtime.learner_actor import Learner
from laminar_jax.weights.source import RelaySource, StoreSource
from laminar_jax.weights.publish import WeightStore
from rollout.worker import RolloutWorker

# learner init and the first publish (compiles included) on a loaded machine
STARTUP_TIMEOUT_S = 600.0


@dataclass
class RolloutSpawner:
    """Creates rollout `index` of `cfg.rollout.assignments()` (restart 0 at start, then 1, 2, ...
    for its replacements), with its pool's config, engine and accelerators: what the manager calls
    to replace a dead rollout. Picklable: it travels to the manager actor."""

    cfg: Any
    data: Any
    source: Any
    model_dir: str | None
    tokenizer: Any
    scorer: Any
    kind: str | None
    accelerators: dict      # base rollout id -> accelerators (cluster.check_resources)
    nodes: list
    prefix: str
    latency_model: Any = None

    def workdir(self, rid: str, engine: str) -> str | None:
        """The tmpfs folder of a vLLM rollout's config.json (removed by `Fleet.stop`)."""
        return os.path.join(self.cfg.relay.store_dir, f"vllm-{self.prefix}-{rid}") if engine == "vllm" else None

    def plan(self, index: int, restart: int = 0) -> "RolloutPlan":
        """What rollout `index` (its `restart`-th replacement) runs with, before any actor exists:
        the one place `rollout.*` and `rollout.pools` reach a rollout (its pool's config, engine
        factory, accelerators and actor environment)."""
        base, pool = self.cfg.rollout.assignments()[index]
        rid = base if restart == 0 else f"{base}.r{restart}"
        rcfg = dataclasses.replace(self.cfg, rollout=self.cfg.rollout.for_pool(pool))
        accel = self.accelerators.get(base, 0.0) if self.kind else 0.0
        env = {"OMP_NUM_THREADS": "1"} if pool.engine == "vllm" and self.kind is None else {}
        factory = engines.EngineFactory(rcfg, self.model_dir, seed=self.cfg.run.seed * 1000 + index + 7919 * restart,
                                        latency_model=self.latency_model, workdir=self.workdir(rid, pool.engine),
                                        accelerators=accel, kind=self.kind)
        return RolloutPlan(rid=rid, pool=pool, cfg=rcfg, factory=factory, accelerators=accel, env=env,
                           node=None if accel else self.nodes[index % len(self.nodes)])

    def __call__(self, index: int, restart: int = 0) -> tuple[str, Any]:
        p = self.plan(index, restart)
        pg = (cluster.placement_group_for(self.kind, p.accelerators, f"{self.prefix}-{p.rid}")
              if self.kind and p.accelerators > 1 else None)
        opts = cluster.actor_options(self.kind, p.accelerators, node=p.node, max_concurrency=8,
                                     placement_group=pg, env=p.env)
        handle = ray.remote(RolloutWorker).options(**opts).remote(
            p.rid, p.cfg, self.data, self.source, p.factory, self.tokenizer, self.scorer)
        # the engine's imports run now, while the rollout waits for its first weights (fire and forget)
        handle.__ray_call__.remote(engines.warm_imports, p.pool.engine, self.cfg.run.compile_cache, p.accelerators)
        return p.rid, handle


@dataclass(frozen=True)
class RolloutPlan:
    """One rollout as `RolloutSpawner.plan` decides it: id, resolved pool, the short-form config
    it runs with, its engine factory, accelerators, extra environment and node (None: placed by
    its accelerators)."""

    rid: str
    pool: Any
    cfg: Any
    factory: Any
    accelerators: float
    env: dict
    node: str | None


@dataclass(frozen=True)
class RunInputs:
    """What the data actor, the learner and the rollouts are built from: the reward, the
    tokenizer, the dataset, the prompt pool's and buffer's arguments, and the longest row the
    data can make (`batch.row_reach`: the learner compiles no length bucket past it)."""

    reward: Any
    tokenizer: Any
    dataset: Any
    pool_kw: dict
    buffer_kw: dict
    reach: int

    @classmethod
    def of(cls, cfg: Any, model_dir: str | None, dataset: Any = None, prompt_lengths: Any = None) -> "RunInputs":
        """dataset / prompt_lengths: already loaded and measured (`preflight.train_inputs`)."""
        reward = resolve_reward(cfg.reward, answer_field=cfg.data.answer_field)
        tokenizer = engines.tokenizer_for(model_dir)
        dataset = dataset if dataset is not None else load_dataset(cfg.data, seed=cfg.run.seed)
        encode = PromptEncoder(tokenizer, chat_template=cfg.data.chat_template)
        pool_kw = prompt_pool_kwargs(cfg.data, seed=cfg.run.seed, dataset=dataset, encode=encode)
        if prompt_lengths is None:
            prompt_lengths = [len(encode(r.prompt)) for r in dataset.rows]
        buffer_kw = buffer_kwargs(cfg.data, seed=cfg.run.seed)
        # the learner takes a whole global batch at once: a smaller buffer could never hold one
        buffer_kw["capacity_groups"] = max(buffer_kw["capacity_groups"], cfg.learner.global_batch_groups)
        return cls(reward, tokenizer, dataset, pool_kw, buffer_kw, row_reach(cfg, prompt_lengths))

    def data_args(self) -> tuple:
        return self.pool_kw, self.buffer_kw

    @staticmethod
    def data_kwargs(cfg: Any) -> dict:
        return dict(mode=cfg.manager.mode, global_batch=cfg.learner.global_batch_groups,
                    max_staleness=cfg.manager.max_staleness)


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
    prefix: str = ""        # names this run's relays, placement groups and vLLM folders
    cfg_store_dir: str = ""  # relay.store_dir, where vLLM rollouts keep their config folders
    learner_hosts: list = field(default_factory=list)   # learner.hosts > 1: every host, leader first
    learner_pg: Any = None   # their placement group (runtime.learner_group)

    @classmethod
    def start(cls, cfg: Any, run_dir: str, model_dir: str | None, *, events=None,
              latency_model: Any = None, resume: bool = True, min_update_s: float = 0.0,
              on_phase: Any = None, dataset: Any = None, prompt_lengths: Any = None) -> "Fleet":
        """Start-up order (DESIGN.md "Processes"): the data and learner actors are created first,
        with the learner's first publish queued behind its init; the rollouts and relays start
        while the learner initialises (the driver names the weight store, so nothing waits for
        the learner but the publish), and the rollouts build their engines on the first weights
        they pull. on_phase(key, text) is told each phase as it ends (key: the summary's
        `startup` entry, text: the start-up line). dataset / prompt_lengths: already loaded and
        measured (`preflight.train_inputs`), else loaded and encoded here."""
        engines.check_engines(cfg, model_dir)
        phase = on_phase or (lambda key, text: None)
        mesh = cfg.mesh
        learner_devices = max(1, mesh.data) * mesh.fsdp * mesh.tensor
        kind = cluster.accelerator_kind()
        need = cluster.check_resources(cfg, learner_devices)
        learner_group.check(cfg, kind)   # learner.hosts: the mesh splits and the hosts can be placed
        inp = RunInputs.of(cfg, model_dir, dataset, prompt_lengths)
        reward, tokenizer, dataset, reach = inp.reward, inp.tokenizer, inp.dataset, inp.reach
        data = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(DataActor).options(
            num_cpus=0, max_concurrency=1).remote(*inp.data_args(), **inp.data_kwargs(cfg))
        nodes = cluster.alive_nodes()
        # the driver names the weight store (on the learner's node; the learner makes the folder),
        # so relays and rollouts start while the learner initialises, not after it
        store = WeightStore(root=os.path.join(cfg.relay.store_dir, f"{cfg.run.name}-{uuid.uuid4().hex[:6]}-{os.getpid()}"),
                            node_id=nodes[0], shared=False)
        hosts, learner_pg = [], None
        if cfg.learner.hosts > 1:   # one learner over several processes (runtime.learner_group)
            learner, hosts, learner_pg = learner_group.start(
                cfg, Learner, (cfg, run_dir, data), dict(resume=resume, min_update_s=min_update_s,
                                                         store_root=store.root, max_row_tokens=reach),
                kind=kind, env=engines.learner_env(cfg), name=f"laminar-learner-{cfg.run.name}-{uuid.uuid4().hex[:6]}")
        else:
            learner = ray.remote(Learner).options(**cluster.actor_options(
                kind, need["learner"], devices=learner_devices, node=nodes[0], max_concurrency=4,
                env=engines.learner_env(cfg))).remote(
                cfg, run_dir, data, resume=resume, min_update_s=min_update_s, store_root=store.root,
                max_row_tokens=reach)
        # the first publish is queued behind the learner's init: it runs the moment the init ends
        published = learner.publish.remote()
        phase("actors", "learner and data actors created; learner initialising (jax, model, optimizer)")
        mcfg = engines.model_config(cfg, model_dir)
        relays, prefix = None, f"laminar-relay-{cfg.run.name}-{uuid.uuid4().hex[:6]}"
        # with relays, a rollout reads the store while its relay is dead or restarting
        source = (RelaySource(prefix, fallback=StoreSource(store, mcfg)) if cfg.relay.enabled
                  else StoreSource(store, mcfg))
        spawn = RolloutSpawner(cfg, data, source, model_dir, tokenizer, RewardScorer(reward), kind,
                               need["rollout"], nodes, prefix, latency_model)
        workers, loops = {}, {}
        # rollouts wait on their source (relay, else the store): they start now and build their
        # engines on the first weights
        for i, (_, pool) in enumerate(cfg.rollout.assignments()):
            rid, workers[rid] = spawn(i)
            loops[rid] = workers[rid].run.remote()
            if events is not None:
                accel = need["rollout"].get(rid, 0.0) if kind else 0.0
                events("rollout_started", rollout=rid, pool=pool.name, engine=pool.engine, accelerators=accel,
                       **engines.vllm_kwargs(accel, kind) if pool.engine == "vllm" else {})
        phase("rollouts", f"{cfg.rollout.num_rollouts} rollouts starting (they wait for the first weights)")
        if cfg.relay.enabled:
            from laminar_jax.weights.relay_group import RelayGroup
            r = cfg.relay
            relay_env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cluster.xla_flags(1)}
            # set_master (on_master_change) waits for the learner's init; the relays' own start-up
            # runs meanwhile. The learner re-announces its newest version to every new master.
            relays = RelayGroup(mcfg, store, nodes=nodes, num_chunks=r.num_chunks or None,
                                t_byte=r.t_byte_s, t_start=r.t_start_s, prefix=prefix,
                                transport=r.transport, stream_timeout_s=r.stream_timeout_s,
                                shared_memory=r.shared_memory, idle_timeout_s=r.idle_timeout_s,
                                max_connections=r.max_connections, max_restarts=r.max_restarts,
                                on_master_change=[lambda m: m.__ray_call__.remote(engines.warm_store_reader),
                                                  lambda m: ray.get(learner.set_master.remote(m),
                                                                    timeout=STARTUP_TIMEOUT_S)],
                                events=events, runtime_env={"env_vars": relay_env},
                                inherit_env=cluster.runtime_env(relay_env) is None)
            relays.start_monitor(r.check_interval_s)
            phase("relays", f"{len(nodes)} relay(s) up")
        ray.get(published, timeout=STARTUP_TIMEOUT_S)
        phase("learner", "learner ready")
        phase("publish", "first weights published; rollouts building engines")
        manager = ray.remote(RolloutManager).options(num_cpus=0, max_concurrency=4).remote(
            cfg, workers, data, spawn=spawn, loops=loops)
        fleet = cls(data, learner, manager, workers, loops, relays, bad_rows=list(dataset.bad_rows),
                    prefix=prefix, cfg_store_dir=cfg.relay.store_dir, learner_hosts=hosts, learner_pg=learner_pg)
        fleet.manager_loop = manager.run.remote()
        return fleet

    def refresh(self) -> dict[str, Any]:
        """`workers` as the manager sees them now (dead ones gone, replacements in)."""
        try:
            self.workers = ray.get(self.manager.handles.remote(), timeout=300)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        return self.workers

    def workdirs(self) -> list[str]:
        """The vLLM rollouts' config folders on this host (made once per rollout, removed at stop)."""
        return sorted(glob.glob(os.path.join(self.cfg_store_dir, f"vllm-{self.prefix}-*")))

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
            self.relay_events = self.relays.collect_events()   # already logged; kept for the breakdown
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
        if self.relays is not None:
            # before the learner's close removes the weight store: a relay restoring a version
            # whose files vanish fails half-way, and tensorstore's reads still in flight then
            # complete on orbax's closed event loop ("Event loop is closed" tracebacks)
            self.relays.stop()
            self.relays.collect_events()   # their last events, logged
        try:
            events += ray.get(self.learner.close.remote(), timeout=300)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # a dead learner: its weight store is removed by run_folder.clean_stale_stores
        if self.relays is not None:
            self.relays.shutdown()
        for handle in [self.learner, *self.learner_hosts[1:], self.manager, self.data, *self.workers.values()]:
            ray.kill(handle, no_restart=True)
        if self.learner_pg is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.learner_pg)
        # the rollouts' placement groups and vLLM config folders (on this host), replacements' too
        from ray.util.placement_group import get_placement_group, placement_group_table, remove_placement_group
        for info in placement_group_table().values():
            if str(info.get("name", "")).startswith(f"{self.prefix}-") and info.get("state") != "REMOVED":
                remove_placement_group(get_placement_group(info["name"]))
        for d in self.workdirs():
            shutil.rmtree(d, ignore_errors=True)
        return events
