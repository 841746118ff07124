"""Every scheduling mode learns (real Ray, real JAX engines and learner) and keeps its staleness
rule on every consumed trajectory: one version per trajectory outside partial mode, staleness =
consuming version - oldest token version, sync 0, one_step and stream at most 1, partial at most
eta with its version-spanning trajectories tagged as mixed.

Learning: from a warm-up on noisy countdown demonstrations (a number skipped with probability
0.4 per step), 20 RL steps raise the mean reward, compared within prompts of the same n
(`analysis.reward_gain`): the raw per-step mean moves with the prompt lengths drawn, and in the
asynchronous modes short answers arrive first."""
import pytest

from laminar_jax.analysis import load_run, reward_gain
from laminar_jax.data.tasks import get_task
from laminar_jax.runtime import driver
from tests.laminar_jax.runtime.runtime_fixtures import MODES, SHARED_MODE, mode_config

MIN_GAIN = 0.05


def check_staleness(mode: str, traj, eta: int | None):
    lag = traj.learner_version - traj.oldest_version
    assert (traj.staleness == lag).all(), "staleness = consuming version - oldest token version"
    assert (traj.staleness >= 0).all()
    # a trajectory spans versions exactly when its oldest token is older than its last
    assert (traj.mixed_versions == (traj.oldest_version < traj.gen_version)).all()
    if mode == "sync":
        assert (traj.staleness == 0).all()
    if mode == "one_step":
        assert traj.staleness.max() <= 1
    if mode == "stream":
        assert traj.staleness.max() <= 1
    if mode == "partial":
        assert traj.staleness.max() <= eta
    else:
        assert not traj.mixed_versions.any(), f"{mode}: a trajectory changed version"


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_learns_and_keeps_its_staleness_rule(mode, cluster, countdown_model, tmp_path, request):
    if mode == SHARED_MODE:   # the package's shared run (conftest.shared_run), made for this test
        cfg, summary = request.getfixturevalue("shared_run")
    else:
        cfg = mode_config(str(tmp_path), mode, countdown_model)
        summary = driver.run(cfg, quiet=True)
    run = load_run(summary["run_dir"])
    m, traj = run.metrics, run.trajectories
    assert len(m) == cfg.run.steps
    assert len(traj) == cfg.run.steps * cfg.learner.global_batch_groups * cfg.data.group_size
    assert traj.groupby("group_id").size().eq(cfg.data.group_size).all(), "whole groups, each once"
    check_staleness(mode, traj, cfg.manager.max_staleness)
    acc = summary["accounting"]
    assert acc["unaccounted"] == 0
    assert acc["issued"] == acc["consumed"] + acc["buffered"] + acc["in_flight"] + acc["requeued"] + acc["dropped"]
    if mode == "partial":
        assert any(e == "pull" for e in run.events.kind)
        assert (traj.staleness > 0).any(), "stale tokens, measured only through learner.mismatch_versions"
    if cfg.rollout.zero_mismatch:
        assert m["mismatch/jax/num_tokens"].sum() == traj.response_len.sum(), "every token measured"
        assert m["mismatch/jax/abs_max"].max() == 0.0, m["mismatch/jax/abs_max"].max()
    # learner.precompile: every bucket's train step compiled (or promised) before the first
    # update, so no update compiles one; without it the first update does
    # (the batch's log-prob pass, the engines' mismatch metrics, likewise)
    compiles, logp_compiles = m["learner/step_compiles"], m["learner/logprob_compiles"]
    if cfg.learner.precompile:
        assert compiles.sum() == 0 and "precompiled" in set(run.events.kind), compiles.tolist()
        assert logp_compiles.sum() == 0, logp_compiles.tolist()
    else:
        assert compiles.iloc[0] >= 1 and "precompiled" not in set(run.events.kind), compiles.tolist()
        assert logp_compiles.iloc[0] >= 1, logp_compiles.tolist()
    # the learner's start-up profile: wall and CPU seconds per init phase
    init = run.events[run.events.kind == "learner_init"].iloc[0]
    assert all(init[f"{p}_cpu_s"] >= 0 for p in ("import", "build", "restore", "store")) and init["import_s"] > 0
    rows = get_task("countdown", num_prompts=cfg.data.num_prompts, max_n=cfg.data.task_max_n,
                    seed=cfg.run.seed).rows()
    n_of = {r.prompt_id: r.row["n"] for r in rows}
    gain = reward_gain(traj.assign(n=traj.prompt_id.map(n_of)), strata="n")
    assert gain["gain"] > MIN_GAIN, gain
