"""An idle rollout waits instead of spinning: the real loop (`run()` in a thread) on a tiny JAX
engine, sync mode, so after its one global batch the data actor issues nothing more until the
learner moves. While idle, the loop blocks in `WeightSource.wait_newer` (IDLE_WAIT_S each), so it
turns a few times per second instead of every 5 ms; newer weights end the wait at once and are
loaded; the time split counts decode and wait time."""
import threading
import time

import numpy as np

from laminar_jax.config import load_config
from laminar_jax.data.records import PromptRow
from laminar_jax.models.hf import hf_to_params, load_pretrained
from laminar_jax.rewards.registry import RewardScorer
from laminar_jax.runtime.data_actor import DataActor
from laminar_jax.runtime.weights_source import WeightSource
from rollout import worker as W
from rollout.jax_engine import JaxEngine
from tests.rollout.rollout_fixtures import JAX_ENGINE_KW, hf_tensors, prompt

GROUP, STOP = 2, 511


class CountingWeights(WeightSource):
    """Fixed tensors; `version` can be raised by the test; counts the worker's asks."""

    def __init__(self, tensors):
        self.tensors, self.version, self.asks, self.waits = tensors, 0, 0, 0
        self.cond = threading.Condition()

    def newer_than(self, version):
        self.asks += 1
        return (self.version, self.tensors) if self.version > version else None

    def wait_newer(self, version, timeout_s):
        self.waits += 1
        with self.cond:
            self.cond.wait_for(lambda: self.version > version, timeout=timeout_s)
        return self.newer_than(version)

    def bump(self):
        with self.cond:
            self.version += 1
            self.cond.notify_all()


class Tok:
    stop_token_ids = (STOP,)

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def _sync_worker(folder, reward):
    """A sync-mode rollout on a tiny JAX engine (groups of GROUP, one global batch of 2 groups),
    its in-process data actor and its counting weight source."""
    cfg = load_config("configs/default.yaml", [
        "manager.mode=sync", f"data.group_size={GROUP}", "rollout.max_concurrency=4", "rollout.temperature=0",
        "rollout.max_new_tokens=6"])
    rows = [PromptRow(f"q{i}", f"p{i}", "x", {"i": i}) for i in range(8)]
    data = DataActor(dict(rows=rows, group_size=GROUP, shuffle=False,
                          encode=lambda s: prompt(int(s[1:]), 5).tolist()),
                     dict(capacity_groups=16), mode="sync", global_batch=2, max_staleness=None)
    mcfg, _ = load_pretrained(folder)
    kw = dict(JAX_ENGINE_KW, max_num_seqs=4, min_rows=4)
    weights = CountingWeights(hf_tensors(folder))
    worker = W.RolloutWorker("r0", cfg, data, weights,
                             lambda t, v: JaxEngine(mcfg, hf_to_params(mcfg, t), **kw, weight_version=v),
                             Tok(), reward)
    return worker, data, weights


def test_idle_rollout_blocks_in_wait_newer_and_wakes_on_new_weights(checkpoint_dirs):
    worker, data, weights = _sync_worker(checkpoint_dirs[0], RewardScorer(lambda prompt, completion, row: 1.0))
    loop = threading.Thread(target=worker.run, daemon=True)
    loop.start()
    try:
        deadline = time.time() + 120
        while data.accounting()["buffered"] < 2:      # the one batch sync mode issues on v0
            assert time.time() < deadline, data.accounting()
            time.sleep(0.05)
        time.sleep(0.3)
        asks, waits, idle = weights.asks, weights.waits, worker.counters["wait_s"]
        time.sleep(1.5)                               # idle: nothing to issue until the learner moves
        turns = weights.waits - waits
        assert turns <= 1.5 / W.IDLE_WAIT_S + 3, turns   # the old loop turned every 5 ms (~300 times)
        assert weights.asks - asks <= 2 * turns + 2
        assert worker.counters["wait_s"] - idle >= 1.2
        weights.bump()                                # newer weights: loaded without waiting out the wait
        deadline = time.time() + 10
        while worker.engine.weight_version != 1:
            assert time.time() < deadline
            time.sleep(0.01)
        c = worker.counters
        assert c["decode_s"] > 0 and c["reload_s"] > 0 and c["decode_s"] <= c["busy_s"]
        assert np.isfinite(c["rpc_s"]) and c["pulls"] == 2
    finally:
        worker.stop()
        loop.join(timeout=30)


class SlowScores:
    """A group's rewards, all set `delay_s` after submission (a reward process at work)."""

    def __init__(self, n, delay_s):
        import concurrent.futures
        from laminar_jax.rewards.registry import RewardResult
        self.futures = [concurrent.futures.Future() for _ in range(n)]
        self.set_at = None

        def finish():
            self.set_at = time.monotonic()
            for f in self.futures:
                f.set_result(RewardResult(1.0))
        threading.Timer(delay_s, finish).start()

    def done(self):
        return all(f.done() for f in self.futures)

    def wait(self, timeout_s):
        import concurrent.futures
        concurrent.futures.wait(self.futures, timeout=timeout_s)
        return self.done()

    def results(self):
        return [f.result() for f in self.futures]


class SlowReward:
    def __init__(self, delay_s):
        self.delay_s, self.submitted = delay_s, []

    def submit_group(self, group, completions):
        self.submitted.append(SlowScores(len(completions), self.delay_s))
        return self.submitted[-1]


def test_a_rollout_waiting_on_rewards_blocks_on_them_not_on_the_weights(checkpoint_dirs):
    """Sync mode, one batch of two groups whose rewards take 0.6 s: once decoding ends the loop
    blocks on the rewards (no `wait_newer` while they are computed: that wait ignores rewards,
    so it held the batch's last group back by up to IDLE_WAIT_S every step), and the groups reach
    the data actor as their rewards come in."""
    reward = SlowReward(0.6)
    worker, data, weights = _sync_worker(checkpoint_dirs[0], reward)
    loop = threading.Thread(target=worker.run, daemon=True)
    loop.start()
    try:
        deadline = time.time() + 120
        while len(reward.submitted) < 2:              # decoding ended: both groups are being scored
            assert time.time() < deadline
            time.sleep(0.01)
        waits = weights.waits
        while data.accounting()["buffered"] < 2:
            assert time.time() < deadline, data.accounting()
            time.sleep(0.005)
        delivered = time.monotonic()
        assert all(s.set_at is not None for s in reward.submitted)
        assert weights.waits - waits <= 1, weights.waits - waits   # the old loop: ~6 (0.6 s / 0.1 s)
        assert delivered - max(s.set_at for s in reward.submitted) < W.IDLE_WAIT_S
        assert worker.counters["reward_s"] >= 0.3
    finally:
        worker.stop()
        loop.join(timeout=30)
