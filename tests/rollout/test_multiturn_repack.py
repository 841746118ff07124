"""Multi-turn trajectories moved between rollouts (repack, failover) on two real JAX engines.

Two RolloutWorkers with real JAX engines on one checkpoint and version, a real RolloutManager
doing the move (`_move`: release -> adopt -> ledger; `_failover`: the partial pool's records ->
adopt), an in-process DataActor, and `CountingEnv`: a deterministic environment whose tool
results depend on its state (a digest of every turn so far), so a state lost in the move would
change the observation tokens and, greedy, everything after them.

Checked: a trajectory moved after its first turn (some waiting on their env.step, some decoding
their second turn) finishes exactly as the same trajectory continued where it was: identical
tokens, loss masks, rewards, turn stats, behaviour log-probs within tolerance, one weight version;
the same from the partial pool's streamed records after the source "dies"; an environment whose
restore fails is reported naming the env (its trajectory starts again from its row); one without
snapshot / restore is never released.
"""
import numpy as np
import pytest

from laminar_jax.config import load_config
from laminar_jax.data.records import PromptRow
from laminar_jax.manager.manager import RolloutManager
from laminar_jax.models.hf import hf_to_params, load_pretrained
from laminar_jax.rewards.registry import RewardScorer
from laminar_jax.runtime.data_actor import DataActor
from rollout.jax_engine import JaxEngine
from rollout.worker import RolloutWorker
from tests.rollout.rollout_fixtures import JAX_ENGINE_KW, hf_tensors, prompt
from tests.rollout.test_worker import FixedWeights

GROUP, PROMPTS = 2, 2
HERE = "tests.rollout.test_multiturn_repack"


class WordTok:
    """Text is token ids written as words; any other word is one id (its characters' sum), so
    tool results and templates encode too. Ids divisible by 9 end a turn (greedy turn lengths
    vary with the context)."""
    stop_token_ids = tuple(range(0, 512, 9))

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)

    def encode(self, text):
        return [int(w) if w.isdigit() else sum(map(ord, w)) % 500 + 1 for w in text.split()]


class CountingEnv:
    """Three policy turns; each tool result is a digest of every turn so far (the env's state)."""

    def __init__(self, cfg=None):
        self.digest, self.turn = 0, 0

    def reset(self, row):
        self.digest, self.turn = int(row["i"]) + 1, 0
        return [{"role": "user", "content": " ".join(map(str, prompt(100 + int(row["i"]), 6)))}]

    def step(self, text):
        ids = [int(w) for w in text.split()]
        self.digest = (self.digest * 31 + sum(ids) + len(ids)) % 997
        self.turn += 1
        if self.turn >= 3:
            return None, self.digest / 997, True, {}
        return f"{self.digest % 500} {self.digest * 7 % 500}", 0.125 * self.turn, False, {"tool_calls": 1}

    def snapshot(self):
        return {"digest": self.digest, "turn": self.turn}

    def restore(self, row, state):
        self.digest, self.turn = int(state["digest"]), int(state["turn"])


class BrokenRestoreEnv(CountingEnv):
    def restore(self, row, state):
        raise KeyError("digest")


class NoSnapshotEnv:
    """CountingEnv without snapshot / restore."""

    def __init__(self, cfg=None):
        self._env = CountingEnv()

    def reset(self, row):
        return self._env.reset(row)

    def step(self, text):
        return self._env.step(text)


def data_actor():
    rows = [PromptRow(f"q{i}", f"p{i}", None, {"i": i}) for i in range(PROMPTS)]
    return DataActor(dict(rows=rows, group_size=GROUP, shuffle=False, max_epochs=1,
                          encode=lambda s: prompt(int(s[1:]), 6).tolist()),
                     dict(capacity_groups=8), mode="laminar", global_batch=1, max_staleness=None)


def make_worker(rid, folder, data, env):
    cfg = load_config("configs/default.yaml", [
        "manager.mode=laminar", f"data.group_size={GROUP}", "rollout.max_concurrency=4", "rollout.temperature=0",
        "rollout.max_new_tokens=14", "data.partial_every_tokens=1000", "data.partial_every_s=1000",
        f"env.name={HERE}:{env}", "env.max_turns=3", "env.max_total_tokens=64", "env.workers=2"])
    mcfg, _ = load_pretrained(folder)

    def make_engine(tensors, v):
        return JaxEngine(mcfg, hf_to_params(mcfg, tensors), **JAX_ENGINE_KW, weight_version=v)

    w = RolloutWorker(rid, cfg, data, FixedWeights(hf_tensors(folder)), make_engine, WordTok(),
                      RewardScorer(lambda p, c, r: 0.0))
    w._start_engine()
    return w, cfg


def tick(worker):
    with worker._lock:
        worker._tick()


def deliver(worker, data, limit=600):
    for _ in range(limit):
        if data.accounting()["buffered"] >= PROMPTS:
            n = data.accounting()["buffered"]
            return {(t.group_id, t.sample_index): t for g in data.buffer.sample(n, 0) for t in g}
        tick(worker)
    raise AssertionError(f"{worker.id}: not delivered ({data.accounting()})")


def after_first_turn(worker, limit=400):
    """Tick until every trajectory has finished its first turn, some wait on their env.step and
    some decode their second turn (none done yet)."""
    for _ in range(limit):
        tick(worker)
        eps = list(worker.turns.episodes.values())
        running = {p.request_id for p in worker.engine.partials()}
        if len(eps) == GROUP * PROMPTS and all(ep.turns >= 1 for ep in eps) \
                and any(ep.pending is not None for ep in eps) and any(ep.rid in running for ep in eps):
            return
    raise AssertionError("never reached a point where trajectories both wait on their env and decode")


@pytest.fixture(scope="module")
def reference(checkpoint_dirs):
    data = data_actor()
    whole, _ = make_worker("whole", checkpoint_dirs[0], data, "CountingEnv")
    got = deliver(whole, data)
    whole.stop()
    assert all(t.turn_stats["turns"] >= 2 and (t.loss_mask == 0).any() for t in got.values()), \
        "the reference trajectories must have tool turns"
    return got


def assert_same(got, reference, holder):
    assert set(got) == set(reference)
    for key, ref in reference.items():
        t = got[key]
        assert t.response_tokens.tolist() == ref.response_tokens.tolist(), key
        assert t.loss_mask.tolist() == ref.loss_mask.tolist(), key
        np.testing.assert_allclose(t.behaviour_logp, ref.behaviour_logp, atol=2e-4)
        assert t.reward == ref.reward and t.finish_reason == ref.finish_reason, key
        for k in ("turns", "tool_calls", "tool_tokens"):
            assert t.turn_stats[k] == ref.turn_stats[k], (key, k)
        assert (t.token_versions == 0).all() and t.gen_version == 0 and not t.mixed_versions
        assert t.rollout_id == holder and t.repack_count == 1, key


def test_a_trajectory_moved_after_its_first_turn_equals_it_continued_where_it_was(checkpoint_dirs, reference):
    data = data_actor()
    (src, cfg), (dst, _) = (make_worker(r, checkpoint_dirs[0], data, "CountingEnv") for r in ("src", "dst"))
    after_first_turn(src)
    phases = sorted(p.episode["phase"] for p in src._snapshot())
    assert "step" in phases and "decode" in phases, phases
    manager = RolloutManager(cfg, {"src": src, "dst": dst}, data)
    manager._move("src", "dst", 0)
    (move,) = [e for e in manager.drain_events() if e["kind"] == "repack"]
    assert move["trajectories"] == GROUP * PROMPTS and not src.groups and not src.turns.episodes
    assert src.engine.stats().kv_used_tokens == 0, "the source kept K/V of trajectories it handed over"
    assert_same(deliver(dst, data), reference, "dst")
    assert dst.counters["adopted"] == GROUP * PROMPTS and dst.counters["restore_failures"] == 0
    assert data.accounting()["unaccounted"] == 0
    src.stop(), dst.stop()


def test_the_partial_pool_holds_completed_turns_a_failover_continues_them(checkpoint_dirs, reference, monkeypatch):
    from laminar_jax.manager import manager as manager_module
    monkeypatch.setattr(manager_module.ray, "kill", lambda *a, **k: None)  # src is no Ray actor here
    data = data_actor()
    (src, cfg), (dst, _) = (make_worker(r, checkpoint_dirs[0], data, "CountingEnv") for r in ("src", "dst"))
    after_first_turn(src)
    src._stream()   # what the pool holds when the rollout dies ...
    pooled = data.partials.get(rollout_id="src")
    assert len(pooled) == GROUP * PROMPTS and all(p.episode["turns"] >= 1 for p in pooled)
    for _ in range(3):
        tick(src)   # ... and work done since, lost with it
    manager = RolloutManager(cfg, {"src": src, "dst": dst}, data)
    manager._failover("src", "killed by the test", {"dst": dst.stats()})
    assert manager.counters["reissued_groups"] == PROMPTS and manager.counters["requeued_groups"] == 0
    assert_same(deliver(dst, data), reference, "dst")
    src.stop(), dst.stop()


def test_a_snapshot_that_cannot_be_restored_is_reported_naming_the_env(checkpoint_dirs, reference):
    data = data_actor()
    (src, cfg), (dst, _) = (make_worker(r, checkpoint_dirs[0], data, "BrokenRestoreEnv") for r in ("src", "dst"))
    after_first_turn(src)
    manager = RolloutManager(cfg, {"src": src, "dst": dst}, data)
    manager._move("src", "dst", 0)
    failed = [e for e in dst.drain_events() if e["kind"] == "env_restore_failed"]
    assert len(failed) == GROUP * PROMPTS == dst.counters["restore_failures"]
    assert all(f"{HERE}:BrokenRestoreEnv" in e["error"] and "KeyError" in e["error"] for e in failed)
    # each starts again from its row on the same version: greedy, the same trajectory
    assert_same(deliver(dst, data), reference, "dst")
    src.stop(), dst.stop()


def test_an_env_without_snapshot_is_never_released(checkpoint_dirs, reference):
    data = data_actor()
    (src, cfg), (dst, _) = (make_worker(r, checkpoint_dirs[0], data, "NoSnapshotEnv") for r in ("src", "dst"))
    after_first_turn(src)
    assert src.release(0) is None and src.release(0) is None and src.groups
    refused = [e for e in src.drain_events() if e["kind"] == "release_refused"]
    assert len(refused) == 1 and src.counters["release_refused"] == 2 and "NoSnapshotEnv" in refused[0]["reason"]
    got = deliver(src, data)
    assert all(t.repack_count == 0 and t.rollout_id == "src" for t in got.values())
    assert {k: t.response_tokens.tolist() for k, t in got.items()} == \
        {k: t.response_tokens.tolist() for k, t in reference.items()}
    src.stop(), dst.stop()
