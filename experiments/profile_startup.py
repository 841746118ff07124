"""Where a run's start-up CPU goes: CPU seconds per process up to the end of the first RL step.

    PYTHONPATH=$PWD .venv/bin/python experiments/profile_startup.py --hf-path <SFT model> [overrides...]

Runs `laminar train configs/default.yaml run.steps=2` (plus the overrides) and samples every
process of the run (the driver and its descendants: Ray's own processes, every actor, the reward
workers) from /proc every 0.2 s. Prints, up to the first step's end (the metrics' `time/unix_s`
of step 0), the CPU seconds of each process (Ray's title: `ray::Learner`, ...), and the machine's
utilisation second by second (the run's processes over all cores). Writes
experiments/results/startup_cpu.json. Linux only. The compile cache is `run.compile_cache` (the default, shared
by every run, unless overridden): run it twice for a warm-cache profile.

Why: start-up on a small machine is CPU-bound; a change that moves work without removing it
(the earlier engine prebuild experiment) leaves the first step where it was. This shows what
there is to remove.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICK = os.sysconf("SC_CLK_TCK")


def _proc(pid: str) -> tuple[int, str, float] | None:
    """(parent pid, name, CPU seconds) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2:].split()
    name = cmd.split()[0] if cmd.startswith("ray::") else " ".join(os.path.basename(w) for w in cmd.split()[:3])
    return int(rest[1]), name[:60], (int(rest[11]) + int(rest[12])) / TICK


def sample(root: int, stop: threading.Event, out: list) -> None:
    """Appends (time, {pid: (name, cpu_s)}) for `root` and its descendants until `stop`."""
    while not stop.is_set():
        procs = {p: _proc(p) for p in os.listdir("/proc") if p.isdigit()}
        procs = {p: v for p, v in procs.items() if v is not None}
        tree, grew = {str(root)}, True
        while grew:
            new = {p for p, (ppid, _, _) in procs.items() if str(ppid) in tree and p not in tree}
            tree |= new
            grew = bool(new)
        out.append((time.time(), {p: procs[p][1:] for p in tree if p in procs}))
        stop.wait(0.2)


def _per_second(samples: list, pid: str, t0: float, n_s: int) -> list[float]:
    """CPU seconds of process `pid` in each second from launch (from its samples' differences)."""
    out, prev = [0.0] * n_s, 0.0
    for t, procs in samples:
        if pid in procs:
            cpu = procs[pid][1]
            out[min(n_s - 1, int(t - t0))] += cpu - prev
            prev = cpu
    return [round(c, 2) for c in out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-path", required=True, help="model folder (an SFT checkpoint: no warm-up in the run)")
    p.add_argument("--work", default="/tmp/laminar-profile-startup")
    p.add_argument("--out", default=os.path.join(REPO, "experiments", "results", "startup_cpu.json"))
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    a = p.parse_args()
    run_dir = os.path.join(a.work, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "laminar_jax.cli", "train", "configs/default.yaml", "run.steps=2",
           f"run.out_dir={a.work}", "run.name=run", f"model.hf_path={a.hf_path}", *a.overrides]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    samples: list = []
    stop = threading.Event()
    thread = threading.Thread(target=sample, args=(proc.pid, stop, samples), daemon=True)
    thread.start()
    output = proc.communicate(timeout=1200)[0]
    stop.set()
    thread.join()
    if proc.returncode:
        raise SystemExit(f"laminar train failed:\n{output[-3000:]}")
    import pandas as pd
    metrics = pd.concat([pd.read_parquet(f) for f in sorted(glob.glob(os.path.join(run_dir, "metrics", "*.parquet")))])
    first = float(metrics.sort_values("step")["time/unix_s"].iloc[0])
    upto = [s for s in samples if s[0] <= first]
    last: dict[str, tuple[str, float]] = {}
    seen: dict[str, float] = {}   # pid -> when the sampler first saw it (s from launch)
    for t, procs in upto:
        last.update(procs)
        for pid in procs:
            seen.setdefault(pid, t - t0)
    n_s = int(first - t0) + 1
    per = sorted(((pid, name, cpu) for pid, (name, cpu) in last.items() if cpu > 0.01), key=lambda r: -r[2])
    cores = os.cpu_count() or 1
    seconds = []
    for k in range(int(first - t0) + 1):
        window = [s for s in upto if t0 + k <= s[0] < t0 + k + 1]
        if len(window) >= 2:
            (ta, pa), (tb, pb) = window[0], window[-1]
            used = sum(cpu - pa.get(pid, (None, 0.0))[1] for pid, (_, cpu) in pb.items())
            seconds.append(round(used / (tb - ta) / cores, 3))
    total = sum(c for _, _, c in per)
    print(f"launch to the first step's end: {first - t0:.1f} s; {total:.1f} CPU s in the run's processes "
          f"({total / (first - t0) / cores:.0%} of {cores} cores)")
    print("  CPU s  from s  name                        CPU s in each second from launch")
    timeline = {}
    for pid, name, cpu in per:
        timeline[pid] = _per_second(upto, pid, t0, n_s)
        print(f"  {cpu:5.2f}  {seen[pid]:6.1f}  {name[:26]:26}  " + " ".join(f"{c:.1f}" for c in timeline[pid]))
    print("utilisation per second: " + " ".join(f"{u:.0%}" for u in seconds))
    print("\n".join(line for line in output.splitlines() if line.startswith("start-up")))
    with open(a.out, "w") as f:
        json.dump(dict(launch_to_first_step_s=first - t0, cpu_s_total=total, cores=cores,
                       per_process=[dict(name=n, cpu_s=c, first_seen_s=round(seen[pid], 2), cpu_s_per_s=timeline[pid])
                                    for pid, n, c in per], utilisation_per_s=seconds,
                       overrides=a.overrides, load_after=os.getloadavg()[0]), f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
