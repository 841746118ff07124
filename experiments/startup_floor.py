"""The floor under `laminar train`'s start-up on this machine: Ray and the run's processes with
their imports, and nothing else.

    PYTHONPATH=$PWD .venv/bin/python experiments/startup_floor.py [--reps 3] [--rollouts 2]

Each rep is a fresh process that starts the embedded Ray exactly as a run does
(`runtime.cluster.start` on configs/default.yaml), then one actor per process of the default
run -- the data actor, the learner, one relay, the manager and `--rollouts` rollouts -- each
of which only imports the modules its role imports at start-up and initialises JAX's backend
where the role uses JAX. No model, no weights, no compile or compile-cache load, no generation,
no step. Prints launch -> Ray up and launch -> every actor ready (the floor) per rep, with the
CPU seconds of the actors. Then, per `--compile-reps`, a fresh process compiles the learner's
update for the smallest length bucket of the default config (advantages and the train step, plus
the batch log-prob pass where the run has one: what the first RL step cannot start without) on an empty compile cache, alone on
the machine: the least a cold start adds. Writes experiments/results/startup_floor.json.

Why: issue 20 asks for <= 10 s from launch to the end of the first RL step with a warm compile
cache. A run's own work (the learner's init and first publish, the engines' builds and compile-
cache loads, the first batch and the first update) comes on top of this floor; what the floor
costs, no change inside the roles can remove -- only fewer processes or a cheaper Ray. Cold, the
budget is 25 s; the first step cannot end before the smallest bucket's update is compiled.
"""
from __future__ import annotations

import time

T_LAUNCH = time.time()   # before any import: the floor counts the driver's own imports too

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAX_ROLE = ("jax", "flax.nnx", "orbax.checkpoint", "laminar_jax.weights.publish")
ROLES = {   # what each role's process imports before it can do its first piece of work
    "data": ("laminar_jax.runtime.data_actor",),
    "learner": JAX_ROLE + ("optax", "laminar_jax.runtime.learner_actor", "laminar_jax.learner.setup",
                           "laminar_jax.runtime.rl_step"),
    "relay": JAX_ROLE + ("laminar_jax.weights.relay",),
    "manager": ("laminar_jax.manager.manager",),
    "rollout": JAX_ROLE + ("rollout.worker", "rollout.jax_engine"),
}


def one(rollouts: int) -> dict:
    """One rep, in this process: Ray up, then every role's actor ready."""
    import ray

    from laminar_jax.config import load_config
    from laminar_jax.runtime import cluster

    @ray.remote(num_cpus=0)
    class Role:
        def __init__(self, modules):
            import importlib
            import resource
            for m in modules:
                importlib.import_module(m)
            if "jax" in modules:
                import jax
                jax.devices()
            self.ready_t = time.time()
            r = resource.getrusage(resource.RUSAGE_SELF)
            self.cpu_s = r.ru_utime + r.ru_stime

        def ready(self):
            return self.ready_t, self.cpu_s

    cfg = load_config(os.path.join(REPO, "configs", "default.yaml"), [])
    cluster.start(cfg)
    ray_up = time.time()
    names = ["data", "learner", "relay", "manager"] + [f"rollout{i}" for i in range(rollouts)]
    actors = [Role.remote(ROLES[n.rstrip("0123456789")]) for n in names]
    ready = ray.get([a.ready.remote() for a in actors], timeout=600)
    ray.shutdown()
    return dict(ray_up_s=ray_up - T_LAUNCH, floor_s=max(t for t, _ in ready) - T_LAUNCH,
                actors_cpu_s=sum(c for _, c in ready), per_role={n: round(c, 2) for n, (_, c) in zip(names, ready)})


def compile_first_bucket() -> dict:
    """In this process, on an empty compile cache: the learner's update for the smallest bucket."""
    import tempfile

    import jax

    from laminar_jax.config import load_config
    from laminar_jax.learner.setup import build
    from laminar_jax.runtime import compile_cache, engine_metrics, rl_step
    compile_cache.enable(tempfile.mkdtemp(prefix="laminar-floor-cache-"))   # as the learner does, empty
    cfg = load_config(os.path.join(REPO, "configs", "default.yaml"), [])
    rows = cfg.learner.global_batch_groups // cfg.learner.mini_batches * cfg.data.group_size   # as the learner
    setup = build(cfg, total_steps=cfg.run.steps)
    fns = rl_step.build(cfg, setup, mini_batch_rows=rows, batch_logp=engine_metrics.needs_batch_logp_pass(cfg, rows))
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), setup.state)
    rows, length = min(rl_step.batch_shapes(cfg, fns), key=lambda s: s[0] * s[1])
    t, c = time.time(), time.process_time()
    fns.precompile(state, rows, length, cfg.learner.global_batch_groups, cfg.learner.global_batch_groups * cfg.data.group_size)
    return dict(shape=[rows, length], wall_s=time.time() - t, cpu_s=time.process_time() - c)


def _fresh(*args: str) -> dict:
    from laminar_jax.runtime.cluster import xla_flags   # what a run's actor processes get
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], cwd=REPO, timeout=900,
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--compile-reps", type=int, default=2)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # a rep's own process
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(REPO, "experiments", "results", "startup_floor.json"))
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.rollouts)))
        return
    if a.compile:
        print(json.dumps(compile_first_bucket()))
        return
    reps = []
    for i in range(a.reps):
        load = os.getloadavg()[0]
        rec = dict(_fresh("--one", "--rollouts", str(a.rollouts)), load_before=load)
        reps.append(rec)
        print(f"rep {i}: Ray up {rec['ray_up_s']:.1f} s, every process ready {rec['floor_s']:.1f} s, "
              f"actors {rec['actors_cpu_s']:.1f} CPU s {rec['per_role']} (load {load:.1f})", flush=True)
    floors = sorted(r["floor_s"] for r in reps)
    summary = dict(floor_s_median=floors[len(floors) // 2], floor_s_min=floors[0], floor_s_max=floors[-1],
                   rollouts=a.rollouts, cores=os.cpu_count())
    print(f"floor (launch -> Ray and {4 + a.rollouts} role processes ready, imports only): median "
          f"{summary['floor_s_median']:.1f} s, range {floors[0]:.1f}-{floors[-1]:.1f} s on {os.cpu_count()} cores")
    compiles = []
    for i in range(a.compile_reps):
        rec = dict(_fresh("--compile"), load_before=os.getloadavg()[0])
        compiles.append(rec)
        print(f"cold compile {i}: the update of bucket {rec['shape']} in {rec['wall_s']:.1f} s, "
              f"{rec['cpu_s']:.1f} CPU s (load {rec['load_before']:.1f})", flush=True)
    if compiles:   # a lower bound: the least of the reps
        summary.update(cold_compile_wall_s_min=min(r["wall_s"] for r in compiles),
                       cold_compile_cpu_s_min=min(r["cpu_s"] for r in compiles))
        print(f"cold: + at least {summary['cold_compile_wall_s_min']:.1f} s ({summary['cold_compile_cpu_s_min']:.1f} "
              f"CPU s) to compile the first bucket's update, alone on the machine")
    with open(a.out, "w") as f:
        json.dump(dict(summary=summary, reps=reps, cold_compiles=compiles), f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
