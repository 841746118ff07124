"""Multi-host learner on CPU: the learner's RL train step and a weight publish, 1 host x 8 fake
devices against 2 hosts x 4 (jax.distributed, gloo collectives over loopback), same mesh
(data, fsdp, tensor) = (4, 2, 1), same model and batches.

Per configuration: the median wall time of a train step (after 2 warm-up steps) and, per host,
the time a publish blocks the learner (device-to-host copy), the time until the version is
complete, and the bytes the host wrote. One host: orbax. Two hosts: each writes only its own
shards and a crc32 manifest (weights/host_shards.py, no gather to host 0); a host's version is
complete once host 0 has seen every host's manifest and finalized the folder. Both configurations share the machine's cores;
on CPU the cross-process all-reduces go through gloo over TCP, so 2 hosts are expected to be
slower here: the point of several hosts is memory (a model that does not fit one), not speed.

    PYTHONPATH=$PWD .venv/bin/python experiments/bench_multihost.py [--steps 6] [--preset tiny]

Prints a table and writes experiments/results/bench_multihost.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, LEN, PROMPT = 16, 64, 8


def _batch(vocab: int, step: int) -> dict:
    rng = np.random.default_rng(step)
    lengths = rng.integers(PROMPT + 8, LEN + 1, ROWS)
    seg = (np.arange(LEN)[None] < lengths[:, None]).astype(np.int32)
    resp = ((np.arange(LEN)[None] >= PROMPT) & (seg > 0)).astype(np.float32)
    return {"tokens": rng.integers(0, vocab, (ROWS, LEN)).astype(np.int32),
            "positions": np.where(seg > 0, np.arange(LEN)[None], 0).astype(np.int32), "segment_ids": seg,
            "response_mask": resp, "staleness": np.zeros((ROWS, LEN), np.float32),
            "advantages": (np.repeat(rng.normal(size=(ROWS, 1)), LEN, 1) * resp).astype(np.float32),
            "behaviour_logp": (-rng.uniform(0.5, 5.0, (ROWS, LEN)) * resp).astype(np.float32)}


def worker(processes: int, pid: int, coordinator: str, out: str, steps: int, preset: str) -> None:
    from laminar_jax.learner import distributed as dist
    dist.initialize(coordinator, num_processes=processes, process_id=pid)
    import jax

    from laminar_jax.config import load_config
    from laminar_jax.learner.setup import build
    from laminar_jax.runtime import rl_step
    from laminar_jax.weights.publish import Publisher, WeightStore

    cfg = load_config(None, [f"model.preset={preset}", "learner.global_batch_groups=4", "data.group_size=4",
                             "mesh.data=4", "mesh.fsdp=2", "learner.precompile=false", f"run.steps={steps + 2}"])
    setup = build(cfg, total_steps=steps + 2)
    fns = rl_step.build(cfg, setup, mini_batch_rows=ROWS)
    state, times = setup.state, []
    for step in range(steps + 2):
        t0 = time.perf_counter()
        # each host builds only its rows (the normaliser is summed over the hosts)
        mine = rl_step.train_inputs(cfg, dist.local_part(_batch(cfg.model.vocab_size, step)))
        state, _ = fns.train(state, dist.global_arrays(mine, setup.mesh))
        times.append(time.perf_counter() - t0)   # metrics on the host: the step has finished
    store = WeightStore.local(os.path.join(os.path.dirname(out), f"store-{processes}"))
    pub = Publisher(store, dtype="bfloat16")
    publish = []
    for v in (1, 2):
        t0 = time.perf_counter()
        pub.publish(v, state.params)
        blocked = time.perf_counter() - t0
        pub.wait_until_written()
        publish.append({"blocked_s": blocked, "written_s": time.perf_counter() - t0})
    pub.close()
    from laminar_jax.weights import host_shards
    final = store.path(2)   # bytes this host wrote: its own shards (several hosts), or the orbax folder
    publish[-1]["bytes"] = (os.path.getsize(host_shards.data_path(final, pid)) if processes > 1 else
                            sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(final) for f in fs))
    with open(f"{out}.{pid}", "w") as f:
        json.dump({"step_s": times[2:], "publish": publish[-1], "params": setup.sharded.num_params(),
                   "local_devices": jax.local_device_count()}, f)


def _run(processes: int, devices: int, tmp: str, steps: int, preset: str) -> list[dict]:
    sys.path.insert(0, ROOT)
    from laminar_jax.learner.distributed import coordinator_address
    coord, out = coordinator_address(), os.path.join(tmp, f"h{processes}")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(processes), str(p), coord, out,
                               str(steps), preset], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for p in range(processes)]
    for p in procs:
        _, err = p.communicate(timeout=1200)
        if p.returncode:
            raise RuntimeError(err[-3000:])
    return [json.load(open(f"{out}.{p}")) for p in range(processes)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--preset", default="tiny")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for hosts, devices in ((1, 8), (2, 4)):
            res = _run(hosts, devices, tmp, a.steps, a.preset)
            rows.append({"hosts": hosts, "devices_per_host": devices, "params": res[0]["params"],
                         "step_s_median": float(np.median([s for r in res for s in r["step_s"]])),
                         "publish_blocked_s": [r["publish"]["blocked_s"] for r in res],
                         "publish_written_s": [r["publish"]["written_s"] for r in res],
                         "publish_bytes": [r["publish"]["bytes"] for r in res]})
    print(f"{'hosts':>5} {'dev/host':>8} {'step s':>8} {'publish blocked s (per host)':>30} "
          f"{'written s (per host)':>24} {'MB written (per host)':>24}")
    for r in rows:
        print(f"{r['hosts']:>5} {r['devices_per_host']:>8} {r['step_s_median']:>8.3f} "
              f"{' '.join(f'{x:.3f}' for x in r['publish_blocked_s']):>30} "
              f"{' '.join(f'{x:.3f}' for x in r['publish_written_s']):>24} "
              f"{' '.join(f'{x / 2**20:.2f}' for x in r['publish_bytes']):>24}")
    ratio = rows[1]["step_s_median"] / rows[0]["step_s_median"]
    print(f"2 hosts / 1 host step time: {ratio:.2f}x (CPU; gloo over loopback); load average {os.getloadavg()[0]:.1f}")
    os.makedirs(os.path.join(ROOT, "experiments", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "experiments", "results", "bench_multihost.json"), "w") as f:
        json.dump({"preset": a.preset, "steps": a.steps, "rows": ROWS, "len": LEN, "configs": rows,
                   "step_ratio_2_over_1": ratio, "unix_time": time.time(),
                   "load_avg_1m_at_end": os.getloadavg()[0]}, f, indent=1)   # a shared machine


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, ROOT)
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]), sys.argv[7])
    else:
        main()
