"""Repack end to end without Ray, deterministic: three RolloutWorkers with real JAX engines (two on
weight version 0, one on version 1 with other weights), a real RolloutManager running its repack
rounds between engine steps, and an in-process DataActor. Responses have a long tail (greedy
decoding stops on a chosen set of tokens, so lengths vary by prompt).

Checked: the manager moves trajectories; every delivered trajectory, moved or not, equals the
greedy run of its own weight version alone (so a moved trajectory finished on its original
version with a correct continuation); moves stay within a version; the ledger balances.
"""
from laminar_jax.config import load_config
from laminar_jax.data.records import PromptRow
from laminar_jax.manager.manager import RolloutManager
from laminar_jax.runtime.data_actor import DataActor
from tests.rollout.rollout_fixtures import prompt
from tests.rollout.test_worker import make_worker

GROUP, PROMPTS, CONCURRENCY = 2, 24, 8


class StopTok:
    """Stops on every id divisible by 9: greedy lengths vary from prompt to prompt."""
    stop_token_ids = tuple(range(0, 512, 9))

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def data_actor():
    rows = [PromptRow(f"q{i}", f"p{i}", "x", {"i": i}) for i in range(PROMPTS)]
    return DataActor(dict(rows=rows, group_size=GROUP, shuffle=False,
                          encode=lambda s: prompt(100 + int(s[1:]), 4 + int(s[1:]) % 5).tolist()),
                     dict(capacity_groups=32), mode="laminar", global_batch=2, max_staleness=None)


def worker(rid, folder, data, version):
    return make_worker(rid, folder, data, tok=StopTok(), version=version, concurrency=CONCURRENCY)


def delivered(data):
    n = data.accounting()["buffered"]
    return [t for g in data.buffer.sample(n, 0) for t in g]


def run_alone(folder, version):
    data = data_actor()
    w = worker("alone", folder, data, version)
    for _ in range(2000):
        if data.accounting()["buffered"] >= PROMPTS:
            break
        with w._lock:
            w._tick()
    return {(t.prompt_id, t.sample_index): t.response_tokens.tolist() for t in delivered(data)}


def test_repack_moves_finish_on_their_version_with_the_uninterrupted_continuation(checkpoint_dirs):
    data = data_actor()
    workers = {"a": worker("a", checkpoint_dirs[0], data, 0), "b": worker("b", checkpoint_dirs[0], data, 0),
               "c": worker("c", checkpoint_dirs[1], data, 1)}
    cfg = load_config("configs/default.yaml", ["manager.mode=laminar", "manager.c_max=0.99",
                                               "manager.roofline_batch=64"])
    manager = RolloutManager(cfg, workers, data)
    for _ in range(3000):
        if data.accounting()["buffered"] >= PROMPTS:
            break
        for w in workers.values():
            with w._lock:
                w._tick()
        manager.round()
    else:
        raise AssertionError(f"not all groups delivered: {data.accounting()}")
    trajs = delivered(data)
    moves = [e for e in manager.drain_events() if e["kind"] == "repack"]
    assert manager.counters["moves"] == len(moves) > 0, "no repack on the long-tail workload"
    assert all(e["source"] != "c" and e["destination"] != "c" for e in moves), "moved across versions"
    moved = [t for t in trajs if t.repack_count > 0]
    assert moved and {t.rollout_id for t in moved} <= {e["destination"] for e in moves}
    lengths = sorted(t.num_tokens for t in trajs)
    assert lengths[-1] >= 2 * max(1, lengths[len(lengths) // 2]), f"no long tail: {lengths}"
    reference = {0: run_alone(checkpoint_dirs[0], 0), 1: run_alone(checkpoint_dirs[1], 1)}
    for t in trajs:
        assert not t.mixed_versions and t.gen_version == int(t.token_versions[0])
        assert t.response_tokens.tolist() == reference[t.gen_version][(t.prompt_id, t.sample_index)], \
            (t.group_id, t.sample_index, t.repack_count)
    acc = data.accounting()
    assert acc["unaccounted"] == 0 and acc["consumed"] == len(trajs) // GROUP >= PROMPTS
