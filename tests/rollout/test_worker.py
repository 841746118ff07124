"""RolloutWorker driven in-process (no Ray): an in-process DataActor, a tiny JAX engine on a random
wide-weight checkpoint (greedy argmaxes far from ties) and fixed weights.

- release on one worker + adopt on another continues every trajectory exactly as an uninterrupted
  greedy run does (same tokens, same behaviour log-probs, one version, repack_count 1);
- adopt refuses another weight version;
- rewards that raise or are NaN, and completions the tokenizer cannot decode, score 0 and are
  logged and counted; the loop goes on and delivers every group.
"""
import math

import numpy as np

from laminar_jax.config import load_config
from laminar_jax.data.records import PromptRow
from laminar_jax.models.hf import hf_to_params, load_pretrained
from laminar_jax.rewards.registry import RewardScorer
from laminar_jax.runtime.data_actor import DataActor
from laminar_jax.runtime.weights_source import WeightSource
from rollout.jax_engine import JaxEngine
from rollout.worker import RolloutWorker
from tests.rollout.rollout_fixtures import JAX_ENGINE_KW, hf_tensors, prompt

GROUP, NEW_TOKENS, STOP = 2, 24, 511


class FixedWeights(WeightSource):
    def __init__(self, tensors, version=0):
        self.tensors, self.version = tensors, version

    def newer_than(self, version):
        return (self.version, self.tensors) if version < self.version or version < 0 else None


class Tok:
    stop_token_ids = (STOP,)

    def __init__(self, bad_id=None):
        self.bad_id = bad_id

    def decode(self, ids):
        if self.bad_id is not None and self.bad_id in ids:
            raise KeyError(f"token id {self.bad_id}")
        return " ".join(str(i) for i in ids)


def config(concurrency=4):
    return load_config("configs/default.yaml", [
        "manager.mode=laminar", f"data.group_size={GROUP}", f"rollout.max_concurrency={concurrency}",
        "rollout.temperature=0", f"rollout.max_new_tokens={NEW_TOKENS}", "data.partial_every_tokens=4"])


def data_actor(num_prompts=4):
    rows = [PromptRow(f"q{i}", f"p{i}", "x", {"i": i}) for i in range(num_prompts)]
    return DataActor(dict(rows=rows, group_size=GROUP, shuffle=False,
                          encode=lambda s: prompt(int(s[1:]), 5 + int(s[1:])).tolist()),
                     dict(capacity_groups=16), mode="laminar", global_batch=2, max_staleness=None)


def make_worker(rid, folder, data, *, tok=None, reward=None, version=0, concurrency=4):
    cfg = config(concurrency)
    mcfg, _ = load_pretrained(folder)
    engine_kw = dict(JAX_ENGINE_KW, max_num_seqs=concurrency, min_rows=concurrency)

    def make_engine(tensors, v):
        return JaxEngine(mcfg, hf_to_params(mcfg, tensors), **engine_kw, weight_version=v)

    return RolloutWorker(rid, cfg, data, FixedWeights(hf_tensors(folder), version), make_engine,
                         tok or Tok(), RewardScorer(reward or (lambda prompt, completion, row: 1.0)))


def tick_until_delivered(worker, data, groups, limit=400):
    for _ in range(limit):
        if data.accounting()["buffered"] >= groups:
            return
        with worker._lock:
            worker._tick()
    raise AssertionError(f"{worker.id}: {groups} groups not delivered in {limit} ticks "
                         f"({data.accounting()})")


def buffered(data):
    n = data.accounting()["buffered"]
    return {(t.group_id, t.sample_index): t for g in data.buffer.sample(n, 0) for t in g}


def test_release_then_adopt_continues_like_an_uninterrupted_greedy_run(checkpoint_dirs):
    folder = checkpoint_dirs[0]
    whole_data = data_actor()
    whole = make_worker("whole", folder, whole_data)
    tick_until_delivered(whole, whole_data, 2)
    reference = buffered(whole_data)
    assert len(reference) == 2 * GROUP

    data = data_actor()
    src, dst = make_worker("src", folder, data), make_worker("dst", folder, data)
    for _ in range(6):  # first weights + take 2 groups, then a few decode steps
        with src._lock:
            src._tick()
    with dst._lock:
        dst._tick()  # dst loads version 0 and takes the next groups (its own batch)
    groups, partials = src.release(0)
    assert len(groups) == 2 and all(p.num_tokens > 0 for p in partials)
    assert not dst.adopt(1, groups, [p.moved_to("dst") for p in partials]), "adopt on another version"
    assert dst.adopt(0, groups, [p.moved_to("dst") for p in partials])
    data.reassign([g.group_id for g in groups], "dst")
    tick_until_delivered(dst, data, 4)
    got = buffered(data)
    assert src.counters["released"] == 1 and dst.counters["adopted"] == len(partials)
    for key, ref in reference.items():
        t = got[key]
        assert t.response_tokens.tolist() == ref.response_tokens.tolist(), key
        np.testing.assert_allclose(t.behaviour_logp, ref.behaviour_logp, atol=2e-4)
        assert t.repack_count == 1 and t.rollout_id == "dst"
        assert (t.token_versions == 0).all() and t.gen_version == 0
    assert data.accounting()["unaccounted"] == 0


def test_bad_rewards_and_undecodable_tokens_are_counted_and_never_stop_the_loop(checkpoint_dirs):
    folder = checkpoint_dirs[0]
    probe_data = data_actor(2)
    probe = make_worker("probe", folder, probe_data)
    tick_until_delivered(probe, probe_data, 2)
    first = buffered(probe_data)[("e0-0", 0)].response_tokens
    bad_id = int(first[0])  # greedy: both samples of group e0-0 start with this token

    def reward(prompt, completion, row):
        if row["i"] == 1:
            raise RuntimeError("reward bug")
        return math.nan if row["i"] == 2 else 1.0

    data = data_actor(3)
    w = make_worker("w", folder, data, tok=Tok(bad_id=bad_id), reward=reward)
    tick_until_delivered(w, data, 3)
    got = buffered(data)
    undecodable = [k for k, t in got.items() if bad_id in t.response_tokens.tolist()]
    assert ("e0-0", 0) in undecodable and ("e0-0", 1) in undecodable
    assert w.counters["decode_errors"] == len(undecodable)
    # row 1's reward raises, row 2's is NaN (groups e0-1 and e0-2: no shuffle)
    raised = [k for k in got if k[0] == "e0-1" and k not in undecodable]
    nan = [k for k in got if k[0] == "e0-2" and k not in undecodable]
    assert raised and nan
    assert w.counters["reward_errors"] == len(raised) + len(nan)
    for k, t in got.items():
        expected = 0.0 if (k in undecodable or k in raised or k in nan) else 1.0
        assert t.reward == expected, k
    kinds = [e["kind"] for e in w.drain_events()]
    assert kinds.count("decode_error") == len(undecodable)
    assert kinds.count("reward_error") == len(raised) + len(nan)
    assert w.failed is None


class SwitchableWeights(FixedWeights):
    """Fixed tensors whose published version the test advances."""


def test_a_released_rollout_that_adopts_keeps_the_adopted_work_on_its_version(checkpoint_dirs):
    """Released (repack source), then chosen as a destination before its next tick, while the
    learner publishes a newer version: the adopted trajectories still finish on their version
    (the release must not license a pull under adopted work)."""
    folder = checkpoint_dirs[0]
    data = data_actor()
    src, dst = make_worker("src", folder, data), make_worker("dst", folder, data)
    weights = SwitchableWeights(hf_tensors(folder), 0)
    src.weights = dst.weights = weights
    for _ in range(6):
        with src._lock:
            src._tick()
    with dst._lock:
        dst._tick()
    dst_groups, dst_partials = dst.release(0)  # dst is released: it may pull newer weights now
    data.requeue([g.group_id for g in dst_groups])
    groups, partials = src.release(0)
    assert dst.adopt(0, groups, [p.moved_to("dst") for p in partials])
    data.reassign([g.group_id for g in groups], "dst")
    weights.version = 1  # a publish lands before dst's next tick
    for _ in range(200):
        if not dst.groups:
            break
        with dst._lock:
            dst._tick()
    got = buffered(data)
    adopted = {g.group_id for g in groups}
    moved = [t for (gid, _), t in got.items() if gid in adopted]
    assert len(moved) == len(adopted) * GROUP
    for t in moved:
        assert (t.token_versions == 0).all() and t.gen_version == 0, (t.group_id, t.token_versions)
    assert data.accounting()["unaccounted"] == 0
