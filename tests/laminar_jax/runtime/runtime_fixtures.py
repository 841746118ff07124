"""Shared fixtures of the runtime tests: one emulated two-node Ray cluster for the package, and
one supervised warm-up (the easy arithmetic task) whose Hugging Face checkpoint every run starts
from. JAX's persistent compilation cache is shared by every actor, so later runs skip compiles."""
import os

import ray

from laminar_jax.config import Config, load_config

CACHE = "/tmp/laminar-test-jax-cache"


def start_cluster():
    """Two raylets on loopback (head + one worker node). A Ray an earlier test module left
    connected (a single local node, e.g. auto-started by a `ray` call) is shut down first, so the
    runtime tests always see the two-node cluster they assert on."""
    if ray.is_initialized():
        ray.shutdown()
    from ray.cluster_utils import Cluster
    env = {"JAX_COMPILATION_CACHE_DIR": CACHE, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PLATFORMS": "cpu"}
    os.environ.update(env)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "include_dashboard": False})
    cluster.add_node(num_cpus=8)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env={"env_vars": env})
    return cluster


def base_config(tmp_dir: str, name: str, model_dir: str, **sections) -> Config:
    """A short arithmetic run from the warm-up checkpoint; `sections` override dotted keys."""
    overrides = [f"run.out_dir={tmp_dir}", f"run.name={name}", f"model.hf_path={model_dir}",
                 "data.task=arithmetic", "data.group_size=8", "data.num_prompts=512", "data.task_max_n=9",
                 "learner.global_batch_groups=4", "learner.max_seq_len=32", "rollout.max_new_tokens=8",
                 "rollout.max_concurrency=32", "rollout.kv_budget_tokens=1024", "optimizer.lr=3e-4",
                 "optimizer.schedule=constant", "manager.repack_interval_s=0.5", "run.steps=10",
                 "reward.fn=task", f"run.compile_cache={CACHE}"]
    overrides += [f"{k}={v}" for k, v in sections.items()]
    return load_config("configs/default.yaml", overrides)


COUNTDOWN = ["data.task=countdown", "data.task_max_n=12", "data.num_prompts=1024", "learner.max_seq_len=48",
             "rollout.max_new_tokens=40"]


def countdown_config(tmp_dir: str, name: str, model_dir: str, **sections) -> Config:
    """The learning check's run: countdown up to 12 (long-tailed answers of 2 to 27 tokens, partial
    credit) from the noisy warm-up of `countdown_warm_up_config`; `sections` override dotted keys."""
    overrides = {k.split("=")[0]: k.split("=")[1] for k in COUNTDOWN}
    overrides.update({"run.steps": 20, "reward.fn": "task", "learner.global_batch_groups": 4,
                      "data.group_size": 8, "rollout.max_concurrency": 32, "rollout.kv_budget_tokens": 2048,
                      "optimizer.lr": 3e-4, "optimizer.schedule": "constant", "manager.repack_interval_s": 0.5})
    overrides.update(sections)
    return load_config("configs/default.yaml", [f"run.out_dir={tmp_dir}", f"run.name={name}",
                                                f"model.hf_path={model_dir}"]
                       + [f"{k}={v}" for k, v in overrides.items()])


# zero-mismatch mode (rollout.zero_mismatch): every token of every trajectory must have the
# learner's log-prob, at the token's own version, bit for bit. In bf16 in sync mode (every
# token fresh); in fp32 in partial mode, where trajectories cross weight switches (the engine
# re-prefills) and learner.mismatch_versions keeps the versions the stale tokens came from.
BF16_EXACT = {"rollout.zero_mismatch": "true", "model.dtype": "bfloat16", "model.rollout_dtype": "bfloat16"}
MODES = {   # test_modes_train.py's runs: manager.mode -> its overrides
    "sync": {"learner.precompile": False, **BF16_EXACT},   # the one mode whose learner compiles in its steps
    "one_step": {},
    "stream": {"learner.mini_batches": 2, "manager.max_staleness": 1},
    "partial": {"manager.max_staleness": 2, "rollout.zero_mismatch": "true", "learner.mismatch_versions": 2},
    "laminar": {"rollout.num_rollouts": 3, "learner.global_batch_groups": 8},
}



# the mode whose run the package shares (conftest.shared_run): checkpointed at every step, it is
# also the run test_analysis_notebook and test_multinode read
SHARED_MODE = "one_step"


def mode_config(tmp_dir: str, mode: str, model_dir: str, **sections) -> Config:
    """test_modes_train.py's run of scheduling mode `mode` (countdown_config with MODES[mode])."""
    return countdown_config(tmp_dir, mode, model_dir, **{"manager.mode": mode, **MODES[mode], **sections})


def countdown_warm_up_config(tmp_dir: str) -> tuple[Config, str]:
    """Supervised warm-up on noisy countdown demonstrations (a number skipped with probability
    0.4 per step): a policy that counts but skips, which RL can sharpen within a few steps."""
    cfg = load_config("configs/default.yaml", [f"run.out_dir={tmp_dir}", "run.name=warm_countdown", *COUNTDOWN,
                                               "sft.steps=300", "sft.batch_size=32", "sft.seq_len=48",
                                               "sft.demo_noise=0.4"])
    return cfg, os.path.join(tmp_dir, "warm_countdown")


def warm_up_config(tmp_dir: str) -> tuple[Config, str]:
    """Supervised warm-up on the arithmetic task."""
    cfg = load_config("configs/default.yaml", [f"run.out_dir={tmp_dir}", "run.name=warm", "data.task=arithmetic",
                                               "sft.steps=100", "sft.batch_size=32", "sft.seq_len=32"])
    return cfg, os.path.join(tmp_dir, "warm")


# fixture name -> its warm-up. Each is `laminar sft` in its own process, as `laminar train` runs
# it (runtime.warm_up): with the XLA flags of a run, not this process's -O0 (tests/conftest.py),
# under which it ran 2.7x slower.
WARM_UPS = {"warm_model": warm_up_config, "countdown_model": countdown_warm_up_config}
_started: dict = {}


def start_warm_ups(names, tmp_dir: str) -> None:
    """Starts the warm-ups of `names` now, in the background (tests/conftest.py does at the end
    of collection), at nice 19: they train on what the in-process tests leave idle of the two
    cores, instead of before the first runtime test, which waits for them (~50 s before). At
    nice 0 they slowed the in-process tests more than that (test_distributed's two processes
    +27 s, test_compose +18 s: one suite each way). Output goes to a log each."""
    from laminar_jax.runtime import warm_up
    for name in names:
        if name not in _started:
            cfg, run_dir = WARM_UPS[name](os.path.join(tmp_dir, name))
            log = open(os.path.join(tmp_dir, f"{name}.log"), "w")
            w = _started[name] = warm_up.WarmUp(cfg, run_dir, announce=False, output=log)
            if w.proc is not None:   # before it imports jax, whose threads inherit the niceness
                os.setpriority(os.PRIO_PROCESS, w.proc.pid, 19)


def warm_up_result(name: str, tmp_dir: str) -> str:
    """The model folder of warm-up `name` (started now if it was not), once it is done."""
    start_warm_ups([name], tmp_dir)
    return _started[name].result(timeout=1800)


def stop_warm_ups() -> None:
    for w in _started.values():
        w.stop()


def cli_env(root: str) -> dict:
    """The environment of a `laminar train` subprocess: this checkout's code, the tests' shared
    compile cache, and no inherited Ray address or auth mode (the run starts its own Ray)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env.update(PYTHONPATH=root, JAX_COMPILATION_CACHE_DIR="/tmp/laminar-test-jax-cache",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return env


def listening(root) -> dict[tuple, str]:
    """{(ip, port): process name} of every LISTEN socket in the psutil process `root`'s tree
    (the loopback audit of a `laminar train` subprocess)."""
    import psutil
    try:
        procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in procs:
            try:
                name = procs[c.pid].name()
            except psutil.NoSuchProcess:
                name = "?"
            out[(c.laddr.ip, c.laddr.port)] = name
    return out


def is_loopback(ip: str) -> bool:
    import ipaddress
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def toy_groups(num_groups: int = 2, group_size: int = 4, seed: int = 0) -> list:
    """Groups of short made-up trajectories (prompt of 5, responses of 2-8 tokens, log-probs
    -1.5, rewards alternating 0/1, version 0) for a learner step without rollouts."""
    import numpy as np

    from laminar_jax.data.records import Trajectory
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num_groups):
        prompt = rng.integers(3, 100, 5)
        out.append([Trajectory(f"g{g}", f"p{g}", i, "rollout-0", prompt, rng.integers(3, 100, n),
                               np.full(n, -1.5), np.full(n, -1.5), np.zeros(n, int), 0, float(i % 2), "stop")
                    for i, n in enumerate(rng.integers(2, 9, group_size))])
    return out
