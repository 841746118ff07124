"""The driver killed: `laminar train` (embedded Ray, relays, rollouts) in a subprocess gets
SIGKILL once a checkpoint is committed -- no handler runs, nothing is closed. Then:

- every process of the run (GCS, raylets, agents, workers, the learner) is gone within a bound,
  and nothing of it listens any more: Ray's processes share the driver's fate;
- the same command again (run.resume=auto, the default) resumes from the last committed
  checkpoint and finishes. The semantics (README, reliability): the checkpoint holds the
  learner, the optimizer, the prompt cursor and the ledger; steps after it are lost and run
  again, the trajectories they consumed are generated again, and the rows the killed run wrote
  past the checkpoint are dropped. So the finished folder logs every step once and every
  trajectory once, each group consumed once, and its ledger is exact;
- the weight store the killed run left in /dev/shm (its learner died unannounced) is removed by
  the resumed run's start (`run_folder.clean_stale_stores`).

Both runs double as the loopback audit (the suite's time is scarce: one pair of `laminar train`
subprocesses for both): their environment has none of the test session's Ray settings, and
every listening socket of every process of each run (driver, GCS, raylets, agents, workers,
relay streams) is sampled with psutil every 0.25 s; each must be on 127.0.0.1 / ::1. The event
log must not carry the relay group's stream token.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from laminar_jax.analysis import load_run
from laminar_jax.runtime import run_folder
from tests.laminar_jax.runtime.runtime_fixtures import cli_env, is_loopback, listening

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STEPS, KILL_AT = 5, 2          # kill once checkpoint v2 is committed, resume to 5 steps
GONE_S = 30.0                  # every process of the killed run exits within this
AUDIT_S = 0.25                 # the loopback audit's sampling period


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _train(tmp_path, model_dir, store_dir, tag):
    env = cli_env(ROOT)
    args = [f"run.out_dir={tmp_path}", "run.name=killed", f"model.hf_path={model_dir}", "data.task=arithmetic",
            "data.group_size=4", "data.num_prompts=256", "data.task_max_n=9", "learner.global_batch_groups=2",
            "learner.max_seq_len=32", "rollout.max_new_tokens=8", "rollout.num_rollouts=1",
            "rollout.max_concurrency=8", "rollout.kv_budget_tokens=256", f"run.steps={STEPS}",
            "run.checkpoint_every=1", "run.checkpoint_every_s=0", "reward.fn=task", "optimizer.schedule=constant",
            f"relay.store_dir={store_dir}", "run.compile_cache=/tmp/laminar-test-jax-cache"]
    out = open(tmp_path / f"{tag}.out", "w+")
    return subprocess.Popen([sys.executable, "-m", "laminar_jax.cli", "train", "configs/default.yaml", *args],
                            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT), out


def _audit(root: psutil.Process, seen: dict[tuple, set[str]]) -> None:
    """Adds every (ip, port) listening in `root`'s tree now, with its process's name: a port's
    process is renamed (ray::IDLE -> ray::RolloutWorker) and its port may be reused late in the
    run, so every name a port had is kept."""
    for addr, name in listening(root).items():
        seen.setdefault(addr, set()).add(name)


def _check_loopback_only(seen: dict[tuple, set[str]], run: str) -> None:
    names = set().union(*seen.values())
    assert {"gcs_server", "raylet"} <= names, (run, names)
    assert any("RelayWorker" in n for n in names), (run, names)     # the relay stream servers
    assert any("RolloutWorker" in n for n in names), (run, names)
    exposed = {k: v for k, v in seen.items() if not is_loopback(k[0])}
    assert not exposed, (run, exposed)


def test_driver_sigkill_leaves_nothing_running_and_the_rerun_resumes_exactly(warm_model, tmp_path):
    run_dir, store_dir = tmp_path / "killed", str(tmp_path / "store")
    proc, out = _train(tmp_path, warm_model, store_dir, "first")
    procs: dict[int, psutil.Process] = {}
    seen: dict[tuple, set[str]] = {}
    try:
        root = psutil.Process(proc.pid)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            procs.update({p.pid: p for p in _tree(root)})
            _audit(root, seen)
            if KILL_AT in run_folder.checkpoints(str(run_dir)):
                break
            time.sleep(AUDIT_S)
        assert proc.poll() is None, open(out.name).read()[-3000:]
        assert KILL_AT in run_folder.checkpoints(str(run_dir)), "no checkpoint in time"
        procs.update({p.pid: p for p in _tree(root)})
        names = {p.name() for p in procs.values() if p.is_running()}
        assert {"gcs_server", "raylet"} <= names, names
        os.kill(proc.pid, signal.SIGKILL)          # the driver: no handler, no shutdown
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.time() + GONE_S
    alive = [p for p in procs.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    while alive and time.time() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    leftover = {}
    for p in alive:
        try:
            leftover[p.pid] = p.name()
        except psutil.NoSuchProcess:
            pass
    try:
        assert not leftover, f"processes of the killed run still alive after {GONE_S:.0f} s: {leftover}"
        listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
                     and c.pid in procs]
        assert not listening, listening
    finally:
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    kept = run_folder.checkpoints(str(run_dir))[-1]
    crashed = load_run(str(run_dir))
    assert kept >= KILL_AT and len(crashed.metrics) >= KILL_AT
    left = glob.glob(os.path.join(store_dir, "*"))
    assert left, "the killed learner's weight store is expected in store_dir (it died unannounced)"

    _check_loopback_only(seen, "killed run")

    proc, out = _train(tmp_path, warm_model, store_dir, "second")
    seen = {}
    try:
        root = psutil.Process(proc.pid)
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            _audit(root, seen)
            time.sleep(AUDIT_S)
        assert proc.poll() == 0, open(out.name).read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    _check_loopback_only(seen, "resumed run")
    # a clean run ends without a traceback: its workers' output comes with the driver's (Ray's
    # log_to_driver); shutdown once printed orbax's "cannot schedule new futures after
    # shutdown" (learner) and tensorstore's "Event loop is closed" (a relay restoring from a
    # store being removed)
    printed = open(out.name).read()
    for bad in ("Traceback", "cannot schedule new futures", "Event loop is closed"):
        assert bad not in printed, printed[max(0, printed.find(bad) - 2000):printed.find(bad) + 2000]
    assert not any(os.path.exists(p) for p in left), "the dead run's weight store was not cleaned"
    run = load_run(str(run_dir))
    assert list(run.metrics.step) == list(range(STEPS)), list(run.metrics.step)
    assert list(run.metrics.version) == list(range(1, STEPS + 1))
    assert list(run.events[run.events.kind == "resumed"].version) == [kept]
    traj = run.trajectories
    assert len(traj) == STEPS * 2 * 4
    assert traj.trajectory_id.is_unique, "a trajectory was logged twice across the kill"
    assert traj.groupby("group_id").size().eq(4).all(), "a group was consumed twice"
    assert (traj.step == traj.learner_version).all()
    # no event field is a secret (the relay group's stream token; counts such as tokens_per_s are
    # not): both runs' events
    events = [json.loads(line) for line in open(run_dir / "events.jsonl")]
    secret = {(e.get("kind"), k) for e in events for k in e
              if k == "token" or k.endswith("_token") or k.startswith("token_") or "auth" in k}
    assert not secret, f"an event carries a token field: {sorted(secret)}"
    (summary,) = [e for e in events if e.get("kind") == "summary"]  # the killed run wrote none
    assert summary["accounting_unaccounted"] == 0, summary  # the ledger balances after the resume


def test_reaper_kills_what_outlives_a_sigkilled_parent():
    """`runtime.reaper` on its own: a parent starts it, then a grandchild in a session of its own
    (as Ray's agents outlive the raylet); SIGKILL of the parent ends the grandchild within a bound,
    and a process the parent never started is left alone."""
    code = ("import subprocess, sys, time; sys.path.insert(0, '.'); from laminar_jax.runtime import reaper; "
            "reaper.start(); p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
            "print(p.pid, flush=True); time.sleep(300)")
    bystander = subprocess.Popen(["sleep", "300"])
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT})
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        time.sleep(3 * 0.5)                      # reaper.POLL_S: the grandchild is recorded
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.time() + 10
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
            time.sleep(0.05)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        assert bystander.poll() is None
    finally:
        bystander.kill()
        if parent.poll() is None:
            parent.kill()
