"""Per-engine metrics of a learner step (`runtime.engine_metrics`) against closed forms, and the
pool / engine resolution they read (`RolloutConfig.assignments`)."""
import numpy as np
import pytest

from laminar_jax.config import load_config
from laminar_jax.runtime import engine_metrics

POOLS = "rollout.pools=[{name: v, engine: vllm, num_rollouts: 1}, {name: j, engine: jax, num_rollouts: 2}]"


def _cfg(*extra):
    return load_config("configs/default.yaml", ["rollout.num_rollouts=3", POOLS, *extra])


def test_mismatch_is_per_engine_on_fresh_tokens_only():
    cfg = _cfg()
    assert engine_metrics.labels(cfg) == {"rollout-0": ("v", "vllm"), "rollout-1": ("j", "jax"),
                                          "rollout-2": ("j", "jax")}
    # rows: vLLM fresh, JAX fresh, JAX stale (staleness 1, left out)
    mask = np.array([[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 1]], np.float32)
    staleness = np.array([[0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 1]], np.float32)
    behaviour = np.zeros((3, 4), np.float32)
    learner = np.array([[9, 0.1, -0.3, 9], [9, 0.2, 0.2, -0.2], [9, 5, 5, 5]], np.float32)
    batch = {"response_mask": mask, "staleness": staleness, "behaviour_logp": behaviour}
    m = engine_metrics.step_metrics(cfg, batch, learner, ["rollout-0", "rollout-1", "rollout-2"])
    d_v, d_j = np.array([0.1, -0.3]), np.array([0.2, 0.2, -0.2])
    for kind, d in (("vllm", d_v), ("jax", d_j)):
        assert m[f"mismatch/{kind}/num_tokens"] == d.size
        np.testing.assert_allclose(m[f"mismatch/{kind}/abs_mean"], np.abs(d).mean(), rtol=1e-6)
        np.testing.assert_allclose(m[f"mismatch/{kind}/abs_max"], np.abs(d).max(), rtol=1e-6)
        np.testing.assert_allclose(m[f"mismatch/{kind}/k3"], np.mean(np.exp(d) - 1 - d), rtol=1e-5)
    assert m["pool/v/trajectories"] == 1 and m["pool/j/trajectories"] == 2


def test_stale_tokens_are_measured_at_their_own_version_when_it_is_kept():
    """learner.mismatch_versions: tokens s versions stale take the learner's log-probs of
    version v - s; tokens staler than the versions held are left out."""
    cfg = _cfg()
    mask = np.array([[0, 1, 1, 1], [0, 1, 1, 1]], np.float32)
    staleness = np.array([[0, 0, 1, 1], [0, 2, 2, 3]], np.float32)   # a row crossing a switch
    behaviour = np.zeros((2, 4), np.float32)
    at = {0: np.full((2, 4), 0.1, np.float32), 1: np.full((2, 4), -0.2, np.float32),
          2: np.full((2, 4), 0.3, np.float32)}
    logp, measured = engine_metrics.at_token_versions(staleness, at)
    np.testing.assert_array_equal(measured, staleness <= 2)
    np.testing.assert_allclose(logp[0], [0.1, 0.1, -0.2, -0.2])
    np.testing.assert_allclose(logp[1, :3], [0.1, 0.3, 0.3])
    batch = {"response_mask": mask, "staleness": staleness, "behaviour_logp": behaviour}
    ids = ["rollout-1", "rollout-2"]
    m = engine_metrics.step_metrics(cfg, batch, logp, ids, measured)
    d = np.array([0.1, -0.2, -0.2, 0.3, 0.3])   # 5 tokens; the staleness-3 one is not held
    assert m["mismatch/jax/num_tokens"] == d.size
    np.testing.assert_allclose(m["mismatch/jax/abs_mean"], np.abs(d).mean(), rtol=1e-6)
    # only the current version held (mismatch_versions 0): the fresh tokens alone
    fresh = engine_metrics.step_metrics(cfg, batch, at[0], ids)
    assert fresh["mismatch/jax/num_tokens"] == 1
    with __import__("pytest").raises(ValueError, match="mismatch_versions"):
        _cfg("learner.mismatch_versions=-1")


def test_short_form_is_one_pool_and_pool_fields_default_to_it():
    short = load_config("configs/default.yaml", ["rollout.num_rollouts=2", "rollout.engine=vllm"])
    assert [(rid, p.name, p.engine) for rid, p in short.rollout.assignments()] == [
        ("rollout-0", "pool0", "vllm"), ("rollout-1", "pool0", "vllm")]
    cfg = _cfg("rollout.kv_budget_tokens=512", "rollout.max_concurrency=8")
    pools = cfg.rollout.pools_resolved()
    assert [(p.kv_budget_tokens, p.max_concurrency) for p in pools] == [(512, 8), (512, 8)]
    one = cfg.rollout.for_pool(pools[0])
    assert (one.engine, one.num_rollouts, one.pools, one.kv_budget_tokens) == ("vllm", 1, (), 512)


def test_the_current_versions_logp_comes_from_the_train_step_where_its_forward_covers_the_batch():
    base = ["learner.global_batch_groups=4", "data.group_size=4"]
    cfg = lambda *x: load_config("configs/default.yaml", [*base, *x])  # noqa: E731
    rows = 16
    assert engine_metrics.logp_from_train_step(cfg(), rows)
    assert engine_metrics.logp_from_train_step(cfg("manager.mode=stream", "learner.mini_batches=2"), rows // 2)
    for extra in (["learner.mini_batches=2"],                  # the second trains on updated params
                  ["learner.micro_batch_size=8"],              # accumulated: no per-row aux
                  ["learner.pack=true", "learner.hosts=2"],    # packed rows over hosts
                  ["loss.correction.old=prox"],                # the pass feeds the loss
                  ["learner.recompute_prox=true"],
                  ["rollout.zero_mismatch=true"]):             # the check is of the standalone forward
        assert not engine_metrics.logp_from_train_step(cfg(*extra), rows // (2 if "mini" in extra[0] else 1)), extra
    assert engine_metrics.logp_from_train_step(cfg("loss.correction.old=ewma"), rows)   # prox from EWMA weights
    assert engine_metrics.logp_from_train_step(cfg("learner.pack=true"), rows)   # one host unpacks its rows


@pytest.mark.parametrize("pack", [False, True])
def test_mismatch_metrics_from_the_train_steps_forward_equal_the_separate_pass(tmp_path, pack):
    """A real learner update (no Ray: the actor class in-process): with the log-probs taken from
    the train step's forward, no separate pass runs, and the mismatch metrics equal those of a
    separate log-prob pass of the same params: bit for bit on the batch's own rows; packed, the
    forward over packed rows (unpacked by `batch.unpack`) equals it to float rounding."""
    from laminar_jax.runtime import batch as B, breakdown
    from tests.laminar_jax.runtime.runtime_fixtures import toy_groups
    from laminar_jax.runtime.learner_actor import Learner

    cfg = load_config("configs/default.yaml", [
        "learner.global_batch_groups=2", "data.group_size=4", "learner.precompile=false", "run.steps=2",
        "learner.max_seq_len=32", "learner.min_bucket=16", f"relay.store_dir={tmp_path}/stores",
        f"learner.pack={str(pack).lower()}"])
    learner = Learner(cfg, str(tmp_path / "run"), data=None, resume=False, store_root=str(tmp_path / "store"))
    assert learner._logp_from_step
    groups = toy_groups()
    batch = B.assemble(groups, learner_version=0, max_seq_len=32, min_len=16, rows=8)
    want = engine_metrics.step_metrics(cfg, batch, learner.fns.logprobs(learner.state.params, batch),
                                       [t.rollout_id for g in groups for t in g])
    calls = []

    def counted(params, b):
        calls.append(b["tokens"].shape)
        return logprobs(params, b)
    logprobs = learner.fns.logprobs
    counted.aot = logprobs.aot
    learner.fns = learner.fns._replace(logprobs=counted)
    learner._times = breakdown.Stopwatch()
    got = learner._update(groups, 1)[0]   # (metrics, trajectory rows, stats)
    assert calls == [], "no separate log-prob pass"
    keys = [k for k in want if k.startswith("mismatch/")]
    if pack:
        assert got["learner/rows"] < 8, "the batch was packed"
        assert keys and {k: got[k] for k in keys} == pytest.approx({k: want[k] for k in keys}, rel=1e-4, abs=1e-6)
    else:
        assert keys and {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert got["mismatch/jax/num_tokens"] == sum(len(t.response_tokens) for g in groups for t in g)
    learner.publisher.close()
