"""Repack end to end without Ray, deterministic: three RolloutWorkers with real JAX engines (two on
weight version 0, one on version 1 with other weights), a real RolloutManager running its repack
rounds between engine steps, and an in-process DataActor. Responses have a long tail (greedy
decoding stops on a chosen set of tokens, so lengths vary by prompt).

Checked: the manager moves trajectories; every delivered trajectory, moved or not, equals the
greedy run of its own weight version alone (so a moved trajectory finished on its original
version with a correct continuation); moves stay within a version; the ledger balances. A
released rollout that starts its next batch on the same version (no newer weights yet) is not
interrupted by a later publish; the heartbeat's `kv_peak` is the highest KV use of the batch in
hand.
"""
from laminar_jax.config import load_config
from laminar_jax.data.records import PromptRow
from laminar_jax.manager.manager import RolloutManager
from laminar_jax.runtime.data_actor import DataActor
from tests.rollout.rollout_fixtures import prompt
from tests.rollout.rollout_fixtures import hf_tensors
from tests.rollout.test_worker import SwitchableWeights, make_worker

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


def test_a_released_rollout_without_newer_weights_finishes_its_next_batch_on_one_version(checkpoint_dirs):
    """Released while no newer weights exist, a rollout takes its next batch on the same version.
    A publish during that batch must wait for the batch to drain: the release does not license
    a pull under fresh work (it used to, interrupting the batch and mixing versions)."""
    data = data_actor()
    weights = SwitchableWeights(hf_tensors(checkpoint_dirs[0]), 0)
    src = worker("src", checkpoint_dirs[0], data, 0)
    src.weights = weights
    for _ in range(3):
        with src._lock:
            src._tick()
    groups, _ = src.release(0)
    data.requeue([g.group_id for g in groups])
    with src._lock:
        src._tick()  # no newer weights: the next batch starts on version 0
    assert src.groups and src.engine.weight_version == 0
    batch = set(src.groups)
    weights.version = 1
    for _ in range(400):
        if not batch & set(src.groups):
            break
        with src._lock:
            src._tick()
    done = [t for t in delivered(data) if t.group_id in batch]
    assert len(done) == len(batch) * GROUP
    assert all(not t.mixed_versions and t.gen_version == 0 for t in done)
    assert src.counters["interrupts"] == 0
    for _ in range(5):  # the drained rollout now moves on to the new weights
        with src._lock:
            src._tick()
    pulls = [e for e in src.drain_events() if e["kind"] == "pull"]
    assert [(e["version"], e["interrupted"]) for e in pulls] == [(0, 0), (1, 0)]


def test_heartbeat_reports_the_batch_kv_peak_that_ramp_down_is_measured_from(checkpoint_dirs):
    data = data_actor()
    w = worker("w", checkpoint_dirs[0], data, 0)
    seen, below = [], 0
    for _ in range(400):
        with w._lock:
            fresh = not w.groups
            w._tick()
            if fresh:
                seen = []  # a new batch
        s = w.stats()
        seen.append(s["kv_used"])
        assert s["kv_peak"] == max(seen), (s, seen)
        below += s["kv_used"] < s["kv_peak"]
        if below and w.groups and data.accounting()["buffered"] >= 2:
            break
    assert below > 0, "never saw a batch drain below its peak"
    assert w.release(w.engine.weight_version) is not None
    s = w.stats()
    assert s["kv_peak"] == s["kv_used"] == 0.0


class SlowModel:
    """A decode model whose steps last 100 s and whose prefill costs 1 s per token."""
    alpha = [0.0] * 257
    prefill_s_per_token = 1.0

    def step_latency(self, n, kv_tokens):
        return 100.0


def test_the_emulated_engine_charges_the_prefill_of_what_each_step_admits(checkpoint_dirs, monkeypatch):
    """A move's re-prefill (prompt + the tokens generated so far) is charged like a fresh
    prompt's; requests the step leaves waiting are not."""
    from laminar_jax.models.hf import load_pretrained
    from laminar_jax.runtime import engines
    from rollout.engine import Request, SamplingParams
    from rollout.jax_engine import JaxEngine
    from tests.rollout.rollout_fixtures import JAX_ENGINE_KW, prompt

    slept = []
    monkeypatch.setattr(engines.time, "sleep", slept.append)
    mcfg, params = load_pretrained(checkpoint_dirs[0])
    engine = engines.LatencyEngine(JaxEngine(mcfg, params, **JAX_ENGINE_KW), SlowModel())
    sp = SamplingParams(temperature=0.0, max_new_tokens=40)
    fresh = [Request(f"g{i}:0", prompt(i, 5 + i), sp, f"g{i}") for i in range(6)]  # 4 run at once
    engine.add(fresh)
    engine.step()
    assert engine.prefill_tokens == 5 + 6 + 7 + 8
    assert 100 + 26 - 50 < slept[-1] <= 100 + 26
    engine.step()  # decode only: the two waiting requests still have no free row
    assert engine.prefill_tokens == 26 and 100 - 50 < slept[-1] <= 100
    engine.abort(["g4:0", "g5:0"])
    (moved,) = engine.abort(["g0:0"])  # as a repack does: it comes back with its tokens so far
    assert moved.response_tokens.shape[0] == 2
    engine.add([moved.to_request()])
    engine.step()
    assert engine.prefill_tokens == 26 + 5 + 2
