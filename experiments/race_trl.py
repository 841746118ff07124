"""A GRPO race on one machine: TRL's GRPOTrainer against Laminar-JAX (laminar and sync modes, on Ray
or colocated in one process: --systems ... laminar-colocated sync-colocated).

    PYTHONPATH=$PWD .venv/bin/python experiments/race_trl.py [--seeds 0 1] [--steps 30]

1. The TRL venv (default experiments/.venv-trl, git-ignored): created and filled on first use with
   torch 2.13.0 (the CPU build this machine kind ships, as scripts/setup.sh pins it), trl and the
   transformers version of the project's venv.
2. One HF init checkpoint (tiny Qwen2 + tokenizer.json): `laminar sft` on the task (the
   supervised warm-up `laminar train` gives a preset), or --init FOLDER.
3. Runs, interleaved (seed by seed, the order rotated each seed): TRL, laminar mode, sync mode,
   each a fresh process on the whole machine, with the same settings: prompts per step x group
   size, max new tokens, temperature 1, PPO-clip loss with symmetric eps, token-mean, no KL,
   group-normalised advantages, AdamW (lr, betas, eps, no weight decay), constant lr, grad-norm
   clip, one optimizer step per batch.
4. Per run: start-up (launch to the first step's end), time to the reward threshold (launch to the
   first step whose mean reward over the last --window steps reaches --threshold), steady s/step
   (median after the first 3 steps), trajectories/s, and the machine's load average: before,
   after, and its mean and max sampled every LOAD_EVERY_S while the run ran (the machine may be
   shared: the load says how much of it each run had).
5. Both sides run pinned to the same cores (--cores, `taskset -c`; default every core), so
   neither side can use a core the other could not.

Writes experiments/results/race_trl.json and prints the table the README carries.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# "<mode>-colocated": that mode with run.colocate (learner and one rollout in one process, no Ray)
SYSTEMS = ("trl", "laminar", "sync", "laminar-colocated", "sync-colocated")
LOAD_EVERY_S = 5.0
RAY_START_TIMEOUT = "timed out during startup"   # Ray's message when its raylet/GCS start too slowly


class LoadSampler:
    """The 1-minute load average sampled every LOAD_EVERY_S on a thread while a run goes."""

    def __init__(self):
        import threading
        self.samples = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(LOAD_EVERY_S):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=LOAD_EVERY_S + 1)
        return {"load_mean": float(np.mean(self.samples)), "load_max": float(np.max(self.samples)),
                "load_samples": len(self.samples)}


def pinned(cmd: list[str], cores: str | None) -> list[str]:
    """cmd under `taskset -c cores` (every process it starts, Ray's included, inherits it)."""
    return ["taskset", "-c", cores, *cmd] if cores else cmd


def ensure_venv(venv: str) -> str:
    """The TRL venv's python, installing it when missing (idempotent)."""
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(py) and subprocess.run([py, "-c", "import trl, torch"], capture_output=True).returncode == 0:
        return py
    import transformers
    print(f"race: installing TRL into {venv} (torch 2.13.0 CPU, transformers {transformers.__version__})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "torch==2.13.0", "trl",
                    f"transformers=={transformers.__version__}"], check=True)
    return py


def init_folder(work: str) -> str:
    """Where `laminar sft ... run.name=init` writes its model (`laminar sft`'s layout)."""
    from laminar_jax.runtime.warm_up import model_dir
    return model_dir(os.path.join(work, "init"))


def build_init(work: str, task: str, sft_steps: int) -> str:
    folder = init_folder(work)
    if not os.path.exists(os.path.join(folder, "config.json")):
        print(f"race: init checkpoint: laminar sft, {sft_steps} steps on {task}", flush=True)
        subprocess.run([sys.executable, "-m", "laminar_jax.cli", "sft", "configs/default.yaml",
                        f"sft.steps={sft_steps}", f"data.task={task}", f"run.out_dir={work}", "run.name=init"],
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), check=True)
        if not os.path.exists(os.path.join(folder, "config.json")):
            raise SystemExit(f"race: laminar sft finished but wrote no model at {folder}")
    return folder


def reached(times: list[float], rewards: list[float], threshold: float, window: int) -> float | None:
    """Time of the first step whose trailing `window`-step mean reward is >= threshold."""
    for i in range(window - 1, len(rewards)):
        if np.mean(rewards[i - window + 1:i + 1]) >= threshold:
            return times[i]
    return None


def score(times: list[float], rewards: list[float], step_s: list[float], a, traj_per_step: int) -> dict:
    steady = step_s[3:] or step_s
    s_per_step = float(np.median(steady)) if steady else None
    return {"steps": len(rewards), "startup_s": times[0] if times else None,
            "time_to_threshold_s": reached(times, rewards, a.threshold, a.window),
            "steady_s_per_step": s_per_step,
            "trajectories_per_s": traj_per_step / s_per_step if s_per_step else None,
            "reward_first5": float(np.mean(rewards[:5])) if rewards else None,
            "reward_last5": float(np.mean(rewards[-5:])) if rewards else None,
            "wall_s": times[-1] if times else None}


def run_trl(py: str, seed: int, init: str, a, work: str) -> dict:
    log = os.path.join(work, f"trl-s{seed}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    settings = dict(repo=REPO, model=init, task=a.task, num_prompts=2048, data_seed=seed, seed=seed,
                    steps=a.steps, max_s=a.max_s, prompts_per_step=a.prompts, group_size=a.group,
                    max_new_tokens=a.max_new_tokens, temperature=1.0, eps=a.eps, lr=a.lr,
                    grad_clip=a.grad_clip, out_dir=os.path.join(work, f"trl-out-s{seed}"), log=log,
                    threads=a.trl_threads)
    path = os.path.join(work, f"trl-s{seed}.json")
    with open(path, "w") as f:
        json.dump(settings, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.trl_threads), MKL_NUM_THREADS=str(a.trl_threads))
    proc = subprocess.run(pinned([py, os.path.join(REPO, "experiments", "race_trl_side.py"), path], a.cores),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=a.max_s + 300)
    if proc.returncode:
        raise RuntimeError(f"TRL run failed:\n{proc.stderr[-3000:]}")
    recs = [json.loads(line) for line in open(log)]
    steps = [r for r in recs if "reward" in r]
    return score([r["t"] for r in steps], [r["reward"] for r in steps], [r["step_s"] for r in steps][1:],
                 a, a.prompts * a.group)


def run_laminar(system: str, seed: int, init: str, a, work: str) -> dict:
    name, (mode, _, placement) = f"{system}-s{seed}", system.partition("-")
    over = [f"model.hf_path={init}", f"run.steps={a.steps}", f"run.seed={seed}", f"run.out_dir={work}",
            f"run.name={name}", "run.log_every=5", f"manager.mode={mode}", f"data.task={a.task}",
            f"data.group_size={a.group}", f"learner.global_batch_groups={a.prompts}",
            f"rollout.max_new_tokens={a.max_new_tokens}", "rollout.temperature=1.0",
            f"optimizer.lr={a.lr}", "optimizer.schedule=constant", f"optimizer.grad_clip={a.grad_clip}",
            "optimizer.weight_decay=0.0", "optimizer.warmup_steps=0",
            f"loss.surrogate.eps_low={a.eps}", f"loss.surrogate.eps_high={a.eps}",
            "loss.aggregation.mode=token-mean", "loss.kl.coef=0.0", *a.set]
    if placement == "colocated":
        over += ["run.colocate=true", "rollout.num_rollouts=1"]
    run_dir = os.path.join(work, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.time()
    for attempt in range(2):   # a shared, overloaded machine can time Ray's own start-up out: once more
        t0 = time.time()
        proc = subprocess.run(pinned([sys.executable, "-m", "laminar_jax.cli", "train", "configs/default.yaml", *over],
                                     a.cores),
                              cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                              timeout=a.max_s + 600)
        if proc.returncode == 0 or RAY_START_TIMEOUT not in proc.stderr:
            break
        print(f"race:   Ray's start timed out (load {os.getloadavg()[0]:.1f}); launching again", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    if proc.returncode:
        raise RuntimeError(f"laminar run failed:\n{proc.stderr[-3000:]}")
    return score_laminar(run_dir, t0, a)


def score_laminar(run_dir: str, t0: float, a) -> dict:
    from laminar_jax.analysis import load_run
    m = load_run(run_dir).metrics.sort_values("step")   # the metrics/ part files
    out = score(list(m["time/unix_s"] - t0), list(m["reward_mean"]), list(m["time/step_wall_s"])[1:],
                a, a.prompts * a.group)
    out["launch_unix_s"] = t0
    from laminar_jax.runtime.breakdown import overhead, summarise
    rows = [dict(r, **overhead(r)) for r in m.to_dict("records")]   # the current definition
    b = summarise(rows)
    out.update(overhead_frac=b["overhead_frac"], update_s_mean=b["update_s"], wait_data_s_mean=b["wait_data_s"],
               step_wall_s_mean=b["step_wall_s"])
    return out


def table(results: list[dict]) -> str:
    lines = ["| system | seed | start-up s | time to threshold s | steady s/step | trajectories/s | "
             "reward first 5 -> last 5 | steps | load avg before / after / mean |",
             "|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, p=1: "not reached" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in results:
        lines.append(f"| {r['system']} | {r['seed']} | {f(r['startup_s'])} | {f(r['time_to_threshold_s'])} | "
                     f"{f(r['steady_s_per_step'], 3)} | {f(r['trajectories_per_s'])} | "
                     f"{f(r['reward_first5'], 3)} -> {f(r['reward_last5'], 3)} | {r['steps']} | "
                     f"{r['load_before']:.1f} / {r['load_after']:.1f} / {r.get('load_mean', float('nan')):.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (both sides)")
    p.add_argument("--max-s", type=float, default=240.0, help="TRL stops after this; laminar is sized by --steps")
    p.add_argument("--task", default="synthetic")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eps", type=float, default=0.2)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--threshold", type=float, default=0.8)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--init", default=None, help="an HF model folder to start from (else laminar sft)")
    p.add_argument("--venv", default=os.path.join(REPO, "experiments", ".venv-trl"))
    p.add_argument("--work", default="/tmp/laminar-race")
    p.add_argument("--out", default=os.path.join(REPO, "experiments", "results", "race_trl.json"))
    p.add_argument("--rescore", action="store_true", help="re-score the runs of --out (no new runs)")
    p.add_argument("--merge", action="store_true",
                   help="keep --out's results of the systems not run now (re-run one side only)")
    p.add_argument("--cores", default=f"0-{(os.cpu_count() or 1) - 1}",
                   help="cores both sides are pinned to (taskset -c; '' for no pinning)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override of both Laminar-JAX runs (repeatable), e.g. rollout.num_rollouts=1")
    p.add_argument("--trl-threads", type=int, default=1,
                   help="torch threads of the TRL process (1: fastest on a loaded machine)")
    a = p.parse_args()
    if a.rescore:
        return rescore(a)
    os.makedirs(a.work, exist_ok=True)
    py = ensure_venv(a.venv) if "trl" in a.systems else None
    init = a.init or build_init(a.work, a.task, a.sft_steps)
    results = []
    for k, seed in enumerate(a.seeds):
        order = list(a.systems[k % len(a.systems):]) + list(a.systems[:k % len(a.systems)])
        for system in order:
            load = os.getloadavg()[0]
            print(f"race: {system} seed {seed} (load {load:.1f})", flush=True)
            sampler = LoadSampler()
            try:
                r = run_trl(py, seed, init, a, a.work) if system == "trl" else run_laminar(system, seed, init, a, a.work)
            finally:
                loads = sampler.stop()
            r.update(system=system, seed=seed, load_before=load, load_after=os.getloadavg()[0], cores=a.cores, **loads)
            print(f"race:   {json.dumps(r)}", flush=True)
            results.append(r)
            with open(a.out + ".partial", "w") as f:   # what a later failure would otherwise lose
                json.dump(results, f, indent=1)
    if a.merge and os.path.exists(a.out):
        with open(a.out) as f:
            old = json.load(f)
        results = [r for r in old["results"] if r["system"] not in a.systems] + results
        a.systems = [s for s in SYSTEMS if any(r["system"] == s for r in results)]
    finish(results, a)


def rescore(a) -> None:
    """Re-reads the laminar runs of an earlier race (its JSON and run folders) with this code's
    scoring; nothing is run again."""
    with open(a.out) as f:
        results = json.load(f)["results"]
    for r in results:
        if r["system"] != "trl":
            t0 = r.get("launch_unix_s")
            if t0 is None:   # older JSON: the launch time is the first step's end minus start-up
                from laminar_jax.analysis import load_run
                m = load_run(os.path.join(a.work, f"{r['system']}-s{r['seed']}")).metrics
                t0 = float(m.sort_values("step")["time/unix_s"].iloc[0]) - r["startup_s"]
            keep = {k: r[k] for k in ("system", "seed", "load_before", "load_after", "load_mean", "load_max",
                                      "load_samples", "cores") if k in r}
            r.clear()
            r.update(score_laminar(os.path.join(a.work, f"{keep['system']}-s{keep['seed']}"), t0, a), **keep)
    finish(results, a)


def finish(results: list[dict], a) -> None:
    summary = {}
    for system in a.systems:
        rs = [r for r in results if r["system"] == system]
        ttt = [r["time_to_threshold_s"] for r in rs]
        summary[system] = {"time_to_threshold_s_mean": float(np.mean(ttt)) if None not in ttt else None,
                           "steady_s_per_step_mean": float(np.mean([r["steady_s_per_step"] for r in rs])),
                           "startup_s_mean": float(np.mean([r["startup_s"] for r in rs])),
                           "runs_reaching_threshold": f"{sum(t is not None for t in ttt)}/{len(ttt)}",
                           "wall_s_min": float(min(r["wall_s"] for r in rs)),
                           "load_mean": float(np.mean([r.get("load_mean", np.nan) for r in rs]))}
    if "trl" in summary:
        base = summary["trl"]
        for system in a.systems:
            s = summary[system]
            s["wall_to_threshold_vs_trl"] = (s["time_to_threshold_s_mean"] / base["time_to_threshold_s_mean"]
                                             if s["time_to_threshold_s_mean"] and base["time_to_threshold_s_mean"]
                                             else None)
            s["s_per_step_vs_trl"] = s["steady_s_per_step_mean"] / base["steady_s_per_step_mean"]
            if base["time_to_threshold_s_mean"] is None and s["time_to_threshold_s_mean"]:
                # TRL never got there: its time to threshold exceeds its shortest run's wall time
                s["wall_to_threshold_vs_trl_at_most"] = s["time_to_threshold_s_mean"] / base["wall_s_min"]
    out = {"settings": {k: v for k, v in vars(a).items() if k not in ("venv", "out", "rescore", "init")},
           "init": a.init or init_folder(a.work),
           "cores": os.cpu_count(), "results": results, "summary": summary}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(table(results))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
