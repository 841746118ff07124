"""Liveness: a run that cannot progress stops with a named error within a bound.

`liveness.verdict` is fed the real reports (an in-process DataActor's `liveness()`, a manager
report): prompts exhausted, every prompt rejected, no producer past manager.liveness_timeout_s
(and a compiling rollout or a larger timeout holds it back). `run.ray_address` that nothing
answers is an error within 15 s through `laminar train`. The end-to-end stop: `laminar train`
(in this process, on the package's Ray cluster) with too few prompts for run.steps stops with a
named error seconds after the prompts ran out, not the learner's 900 s stall. A final checkpoint
past the driver's SAVE_TIMEOUT_S is a LivenessError that says what is on disk.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from laminar_jax import cli
from laminar_jax.config import load_config
from laminar_jax.data.records import PromptRow, Trajectory
from laminar_jax.runtime import cluster, liveness
from laminar_jax.runtime.data_actor import DataActor

G = 2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _data(max_epochs=1, prompts=4):
    rows = [PromptRow(f"q{i}", f"p{i}", "x", {}) for i in range(prompts)]
    return DataActor(dict(rows=rows, group_size=G, shuffle=False, encode=lambda s: [3, 4], max_epochs=max_epochs),
                     dict(capacity_groups=16), mode="laminar", global_batch=2, max_staleness=None)


def _group(g):
    return [Trajectory(g.group_id, g.prompt_id, i, "x", np.asarray([3, 4]), np.asarray([5]), np.zeros(1),
                       np.zeros(1), np.zeros(1, np.int64), 0, 1.0, "stop") for i in range(G)]


def _cfg(**keys):
    return load_config("configs/default.yaml", [f"{k}={v}" for k, v in keys.items()])


LIVE = {"live": ["x"], "restartable": True, "restarts": 0, "starting": []}


def test_prompts_exhausted_is_an_error_once_nothing_is_in_flight():
    data, cfg = _data(max_epochs=1), _cfg(**{"run.steps": 10, "learner.global_batch_groups": 2})
    groups = data.issue(8, "x", 0)
    assert len(groups) == 4                      # one pass of 4 prompts, then nothing
    for g in groups[:3]:
        assert data.deliver(_group(g))
    assert data.sample(2, 0) and len(data.sample(2, 1)) == 0   # one batch consumed, one group left
    # a group still in flight: it may yet complete a batch
    assert liveness.verdict(data.liveness(), LIVE, 10.0, cfg=cfg, step=1, exhausted_for_s=10) is None
    data.deliver(_group(groups[3]))
    data.sample(2, 1)
    live = data.liveness()
    assert live["exhausted"] and live["in_flight"] == 0
    assert liveness.verdict(live, LIVE, 10.0, cfg=cfg, step=2, exhausted_for_s=0.5) is None  # grace
    why = liveness.verdict(live, LIVE, 10.0, cfg=cfg, step=2, exhausted_for_s=5)
    assert why.startswith("prompts exhausted: data.max_epochs=1 passes over 4 prompts ended at step 2")
    assert "raise data.max_epochs or lower run.steps" in why


def test_every_prompt_rejected_is_an_error_naming_the_first_rejection():
    data, cfg = _data(max_epochs=0), _cfg()
    for g in data.issue(3, "x", 0):
        data.reject(g.group_id, "prompt of 40 tokens exceeds the context")
    assert liveness.verdict(data.liveness(), LIVE, 1.0, cfg=cfg, step=0) is None   # 3 of 4 so far
    data.reject(data.issue(1, "x", 0)[0].group_id, "prompt of 40 tokens exceeds the context")
    why = liveness.verdict(data.liveness(), LIVE, 1.0, cfg=cfg, step=0)
    assert why.startswith("every prompt was rejected (4 groups, none generated)")
    assert "e0-0: prompt of 40 tokens exceeds the context" in why


@pytest.mark.parametrize("timeout_s, starting, stops", [(60, [], True), (60, ["x"], False), (600, [], False)])
def test_no_producer_for_liveness_timeout_s_is_an_error(timeout_s, starting, stops):
    data, cfg = _data(max_epochs=0), _cfg(**{"manager.liveness_timeout_s": timeout_s})
    data.issue(2, "x", 0)
    data.last_progress = time.time() - 90          # nothing delivered or streamed for 90 s
    why = liveness.verdict(data.liveness(), dict(LIVE, starting=starting), 90.0, cfg=cfg, step=4)
    assert (why is not None) == stops
    if stops:
        assert "manager.liveness_timeout_s=60" in why and "waited 90 s" in why


def test_unreachable_ray_address_is_a_named_error_within_15_s():
    t0 = time.time()
    with pytest.raises(cluster.ClusterError, match=r"run.ray_address='127.0.0.1:1': no Ray cluster answers"):
        cluster.check_reachable("127.0.0.1:1")
    assert time.time() - t0 < 15
    # through the CLI (Ray alone retries for minutes; the limit leaves room for a loaded machine's
    # imports, which take most of the time here)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-m", "laminar_jax.cli", "train", "configs/default.yaml",
                          "run.ray_address=127.0.0.1:1", "model.hf_path=/nonexistent-but-unused",
                          "data.task=arithmetic"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    # the pre-Ray check (laminar_jax.preflight) names the key and the address, one line, exit 2
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "run.ray_address: '127.0.0.1:1': cannot connect within 5 s" in line


def test_event_limiter_writes_a_burst_per_kind_and_source_then_one_count():
    from laminar_jax.runtime.events import EventLimiter
    now, out = [0.0], []
    lim = EventLimiter(lambda kind, **f: out.append((kind, f)), burst=3, window_s=10.0, clock=lambda: now[0])
    for i in range(1000):                       # every prompt rejected, as fast as it can
        lim("group_rejected", rollout="r0", group_id=f"e0-{i}")
    lim("group_rejected", rollout="r1", group_id="x")   # another source has its own budget
    now[0] = 11.0
    lim("group_rejected", rollout="r0", group_id="late")
    lim.flush()
    kinds = [k for k, _ in out]
    assert kinds.count("group_rejected") == 3 + 1 + 1
    (sup,) = [f for k, f in out if k == "events_suppressed"]
    assert sup == {"event": "group_rejected", "source": "r0", "count": 997, "window_s": 10.0}


@pytest.mark.slow
def test_a_run_stops_when_prompts_run_out_with_the_key_to_change(cluster, warm_model, tmp_path, capsys):
    """data.max_epochs=1 over 8 prompts feeds two steps of run.steps=10: the run (relays and two
    rollouts, as a default run) stops with one `error:` line naming the key, exit code 1, no
    traceback; its event log carries no stream token. (Before the suite's budget was tight this
    run was a `laminar train` subprocess of its own; the loopback audit it doubled as now runs
    on the driver-kill test's two subprocesses, test_resume_driver_kill.py.)"""
    args = [f"run.out_dir={tmp_path}", "run.name=audit", f"model.hf_path={warm_model}", "data.task=arithmetic",
            "data.group_size=4", "data.num_prompts=8", "data.max_epochs=1", "data.task_max_n=9",
            "learner.global_batch_groups=4", "learner.max_seq_len=32", "rollout.max_new_tokens=8",
            "rollout.num_rollouts=2", "rollout.max_concurrency=16", "rollout.kv_budget_tokens=512",
            "run.steps=10", "reward.fn=task", "manager.repack_interval_s=0.5"]
    rc = cli.main(["train", "configs/default.yaml", *args])
    stdout, stderr = capsys.readouterr()
    assert rc == 1, stderr[-3000:]
    assert "laminar train stopped: prompts exhausted: data.max_epochs=1 passes over 8 prompts" in stderr, stderr[-3000:]
    assert "step    1/9" in stdout, stdout[-2000:]   # steps 0 and 1 ran (0-based, as the metrics)
    assert "Traceback" not in stderr and "error: laminar train stopped: prompts exhausted" in stderr
    events = [json.loads(line) for line in open(tmp_path / "audit" / "events.jsonl")]
    assert not any("token" in k for e in events for k in e), "an event carries a token field"


def test_a_final_checkpoint_past_its_timeout_is_a_named_error(cluster, monkeypatch, tmp_path):
    """The last step's save is waited for SAVE_TIMEOUT_S, then stops with what is kept on disk
    (before: Ray's bare GetTimeoutError). A real actor whose save outlasts the timeout."""
    import types

    import ray

    from laminar_jax.runtime import driver

    @ray.remote(num_cpus=0)
    class SlowLearner:
        def save_checkpoint(self):
            time.sleep(5)
            return 1

    learner = SlowLearner.remote()
    monkeypatch.setattr(driver, "SAVE_TIMEOUT_S", 0.5)
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)        # a committed checkpoint
    (tmp_path / "checkpoints" / "7.orbax-checkpoint-tmp").mkdir()  # the save in progress
    try:
        t0 = time.time()
        with pytest.raises(liveness.LivenessError,
                           match=r"final checkpoint \(after step 7\).*0.5 s.*resume starts from checkpoint 4$"):
            driver._final_save(types.SimpleNamespace(learner=learner), 7, str(tmp_path))
        assert time.time() - t0 < 4
    finally:
        ray.kill(learner)
