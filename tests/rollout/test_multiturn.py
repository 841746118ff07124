"""The rollout worker's multi-turn loop (rollout/multiturn.py), driven in-process (no Ray) with an
in-process DataActor, the real lookup environment and char tokenizer, and a SCRIPTED engine (a
test double of the engine protocol: it writes a fixed policy's tokens, one per step per request,
so the turns are known; the real JAX engine's resume-with-prefix is covered by its contract tests
and the end-to-end tool run).

- a tool call ends the turn; the observation enters the same trajectory with loss mask 0 and
  behaviour log-prob 0; the trajectory continues and its answer is scored by the environment;
- other trajectories keep decoding while one waits on a slow tool;
- one weight version per trajectory across its turns: newer weights offered while a trajectory
  waits on its tool are pulled only after it is delivered;
- env.max_turns, env.max_tool_calls and env.max_total_tokens end trajectories ("length");
- an environment that raises costs its trajectory only (reward 0, mask all 0, counted).
"""
import re
import threading
import time

import numpy as np

from laminar_jax.config import load_config
from laminar_jax.data.char_tokenizer import CharTokenizer
from laminar_jax.data.records import PromptRow
from laminar_jax.env.lookup import LookupEnv, call_text
from laminar_jax.env.protocol import StepResult
from laminar_jax.rewards.registry import RewardScorer
from laminar_jax.runtime.data_actor import DataActor
from laminar_jax.runtime.weights_source import WeightSource
from rollout.engine import Completion, EngineStats, Partial, Timings
from rollout.worker import RolloutWorker

TOK = CharTokenizer()
EOS = TOK.eos_token_id
GROUP = 2


class ScriptedEngine:
    """Engine-protocol test double: `policy(context_text) -> turn text`; the turn's tokens (then
    EOS) come out one per step; versions are the engine's weight version at each token."""

    kind = "scripted"
    max_model_len = 512

    def __init__(self, policy, version=0):
        self.policy, self.weight_version = policy, version
        self.running: dict = {}
        self.log: list = []   # (time, request id) of every generated token

    def add(self, requests):
        for r in requests:
            context = TOK.decode(np.concatenate([r.prompt_tokens, r.prefix_tokens]), skip_special_tokens=False)
            plan = TOK.encode(self.policy(context)) + [EOS]
            self.running[r.id] = dict(req=r, plan=plan, toks=list(r.prefix_tokens), vers=list(r.prefix_versions),
                                      lp=list(r.prefix_logp), added=time.time())

    def step(self):
        out = []
        for rid, s in list(self.running.items()):
            s["toks"].append(s["plan"].pop(0))
            s["vers"].append(self.weight_version)
            s["lp"].append(-0.5)
            self.log.append((time.time(), rid))
            full = len(s["toks"]) >= s["req"].sampling.max_new_tokens
            if s["toks"][-1] == EOS or full:
                del self.running[rid]
                n = len(s["toks"])
                out.append(Completion(rid, s["req"].group_id, s["req"].prompt_tokens, np.asarray(s["toks"]),
                                      np.asarray(s["lp"], np.float32), np.asarray(s["lp"], np.float32),
                                      np.asarray(s["vers"]), "stop" if s["toks"][-1] == EOS else "length",
                                      self.weight_version, len(s["req"].prefix_tokens),
                                      Timings(s["added"], s["added"], time.time())))
                assert n
        return out

    def partials(self):
        return [Partial(rid, s["req"].group_id, s["req"].prompt_tokens, np.asarray(s["toks"]),
                        np.asarray(s["lp"], np.float32), np.asarray(s["lp"], np.float32), np.asarray(s["vers"]),
                        s["req"].sampling, self.weight_version) for rid, s in self.running.items()]

    def abort(self, ids):
        out = [p for p in self.partials() if p.request_id in set(ids)]
        for i in ids:
            self.running.pop(i, None)
        return out

    def load_weights(self, tensors, version):
        self.weight_version = version

    def stats(self):
        return EngineStats(0.1, 1, 100, len(self.running), 0, self.weight_version)

    def has_unfinished(self):
        return bool(self.running)


def lookup_policy(context):
    """Call the tool with the prompt's key, then answer the value the tool returned."""
    got = re.findall(r"result: (\d+)", context)
    if got:
        return got[-1]
    return call_text(int(context.split("?")[0]))


class Weights(WeightSource):
    def __init__(self):
        self.version = 0

    def newer_than(self, version):
        return (self.version, {}) if version < self.version else None


def run_worker(policy, *, overrides=(), env=None, rows=None, until_groups=2, weights=None, on_tick=None,
               engine_cls=ScriptedEngine):
    cfg = load_config("configs/default.yaml", [
        "manager.mode=laminar", f"data.group_size={GROUP}", "rollout.max_concurrency=4", "rollout.max_new_tokens=80",
        "env.name=lookup", "env.max_total_tokens=120", "env.workers=4", *overrides])
    rows = rows or [PromptRow(f"q{i}", f"{k}?", None, {"key": k, "value": v})
                    for i, (k, v) in enumerate([(37, 52), (81, 14), (23, 99), (45, 10)])]
    data = DataActor(dict(rows=rows, group_size=GROUP, shuffle=False, encode=TOK.encode),
                     dict(capacity_groups=16), mode="laminar", global_batch=2, max_staleness=None)
    engines = []

    def make_engine(tensors, v):
        engines.append(engine_cls(policy, v))
        return engines[-1]

    worker = RolloutWorker("r0", cfg, data, weights or Weights(), make_engine, TOK,
                           RewardScorer(lambda p, c, r: 0.0))
    if env is not None:
        worker.turns.make_env = env
    worker._start_engine()
    for _ in range(3000):
        if data.accounting()["buffered"] >= until_groups:
            break
        with worker._lock:
            worker._tick()
        if on_tick:
            on_tick(worker)
    worker.stop()
    n = data.accounting()["buffered"]
    assert n >= until_groups, data.accounting()
    trajs = [t for g in data.buffer.sample(n, 0) for t in g]
    return worker, trajs, engines[0]


def test_tool_output_enters_the_trajectory_with_loss_mask_zero_and_the_answer_is_scored():
    worker, trajs, _ = run_worker(lookup_policy)
    assert len(trajs) == 2 * GROUP
    for t in trajs:
        key, value = int(TOK.decode(t.prompt_tokens)[:-1]), {37: 52, 81: 14, 23: 99, 45: 10}
        text = TOK.decode(t.response_tokens, skip_special_tokens=False)
        assert text == call_text(key) + "</s>" + f"\nresult: {value[key]}" + f"{value[key]}</s>"
        obs = np.flatnonzero(t.loss_mask == 0)
        assert TOK.decode(t.response_tokens[obs]) == f"\nresult: {value[key]}"
        assert obs.tolist() == list(range(obs[0], obs[0] + len(obs))), "one contiguous tool turn"
        assert (t.behaviour_logp[obs] == 0).all() and (t.behaviour_logp[t.loss_mask == 1] == -0.5).all()
        assert t.reward == 1.0 and t.finish_reason == "stop"
        assert t.turn_stats["turns"] == 2 and t.turn_stats["tool_calls"] == 1
        assert t.turn_stats["correct_tool_calls"] == 1 and t.turn_stats["tool_tokens"] == len(obs)
        assert t.log_row()["env_tool_calls"] == 1.0
    assert worker.stats()["env_tool_calls"] == 2 * GROUP


class SlowEnv(LookupEnv):
    """Sample with key 37 waits 0.4 s on its tool; records when."""
    spans: list = []

    def step(self, text):
        t0 = time.time()
        if self.row["key"] == 37 and "<tool_call>" in text:
            time.sleep(0.4)
        out = super().step(text)
        SlowEnv.spans.append((self.row["key"], t0, time.time()))
        return out


def test_other_trajectories_keep_decoding_while_one_waits_on_its_tool():
    SlowEnv.spans = []
    _, trajs, engine = run_worker(lookup_policy, env=lambda: SlowEnv())
    (_, t0, t1), *_ = [s for s in SlowEnv.spans if s[0] == 37]
    slow = next(t.group_id for t in trajs if TOK.decode(t.prompt_tokens) == "37?")
    batch = {rid for t, rid in engine.log if t < t0}   # the requests decoding when the slow call began
    others = [(t, rid) for t, rid in engine.log if rid in batch and not rid.startswith(slow + "/")]
    during = [rid for t, rid in others if t0 < t < t1]
    assert during, "the engine went on decoding other trajectories during the slow tool call"
    assert max(t for t, _ in others) < t1, "the other group finished all its turns while the tool ran"
    assert all(t.reward == 1.0 for t in trajs)


def test_one_weight_version_per_trajectory_across_its_turns():
    weights, seen = Weights(), []

    def offer_new_weights(worker):
        worker._last_poll = 0.0   # no 20 ms poll throttle: every idle tick may pull (else timing decides)
        if worker.turns.waiting() and weights.version == 0:
            weights.version = 1   # newer weights appear while trajectories wait on their tools
        seen.append((worker.engine.weight_version, worker.turns.waiting(), len(worker.groups)))

    _, trajs, engine = run_worker(lookup_policy, weights=weights, on_tick=offer_new_weights, until_groups=4)
    assert any(t.gen_version == 0 for t in trajs) and any(t.gen_version == 1 for t in trajs), \
        [(t.group_id, t.gen_version) for t in trajs]
    assert all((t.token_versions == t.gen_version).all() for t in trajs), "a trajectory changed version"
    # the pull came only once the first batch (every waiting trajectory) was done
    switch = next(i for i, (v, _, _) in enumerate(seen) if v == 1)
    assert switch > 0 and seen[switch - 1][1] == 0, seen[max(0, switch - 3):switch + 1]


class EndlessEnv:
    """Never done: every step is one tool call answered with 'x'."""

    def __init__(self, raise_on=None):
        self.raise_on = raise_on

    def reset(self, row):
        if self.raise_on == "reset" and row["key"] == 37:
            raise RuntimeError("reset broke")
        self.row = row
        return [{"role": "user", "content": f"{row['key']}?"}]

    def step(self, text):
        if self.raise_on == "step" and self.row["key"] == 37:
            raise RuntimeError("env broke")
        return StepResult("x", 0.25, False, {"tool_calls": 1})


def ask(context):
    return "go"


def test_limits_end_trajectories():
    _, trajs, _ = run_worker(ask, env=EndlessEnv, overrides=["env.max_turns=3", "env.max_tool_calls=10"])
    assert all(t.turn_stats["turns"] == 3 and t.finish_reason == "length" for t in trajs)
    assert all(t.reward == 0.75 for t in trajs), "the sum of the step rewards"
    _, trajs, _ = run_worker(ask, env=EndlessEnv, overrides=["env.max_turns=9", "env.max_tool_calls=1"])
    assert all(t.turn_stats["turns"] == 2 and t.turn_stats["tool_calls"] == 2 for t in trajs)
    _, trajs, _ = run_worker(ask, env=EndlessEnv, overrides=["env.max_turns=99", "env.max_tool_calls=99",
                                                            "env.max_total_tokens=30"])
    assert all(t.num_tokens <= 30 and t.finish_reason == "length" for t in trajs)
    assert all(t.turn_stats["turns"] == 3 for t in trajs), "3 + 11 + 3 + 11 + 2 (cut) tokens"


def test_an_environment_that_raises_costs_its_trajectory_only():
    for where in ("step", "reset"):
        worker, trajs, _ = run_worker(ask, env=lambda: EndlessEnv(raise_on=where), overrides=["env.max_turns=2"])
        broken = [t for t in trajs if TOK.decode(t.prompt_tokens) in ("37?", "")]
        ok = [t for t in trajs if t not in broken]
        assert len(broken) == GROUP and len(ok) == GROUP
        assert all(t.reward == 0.0 and t.finish_reason == "abort" and not t.loss_mask.any() for t in broken)
        assert all(t.reward == 0.5 and t.loss_mask.any() for t in ok)
        assert worker.stats()["env_env_errors"] == GROUP
        assert sum(e["kind"] == "env_error" for e in worker.drain_events()) == GROUP
        assert threading.active_count() < 50


class SleepyEnv(EndlessEnv):
    """Every step takes 0.3 s; counts how many steps run at once."""
    lock, running, most = threading.Lock(), 0, 0

    def step(self, text):
        with SleepyEnv.lock:
            SleepyEnv.running += 1
            SleepyEnv.most = max(SleepyEnv.most, SleepyEnv.running)
        time.sleep(0.3)
        with SleepyEnv.lock:
            SleepyEnv.running -= 1
        return super().step(text)


def test_step_timeout_and_workers_change_what_the_loop_does():
    # env.step_timeout_s: a step slower than it costs its trajectory; a longer limit lets it finish
    worker, trajs, _ = run_worker(ask, env=SleepyEnv, overrides=["env.max_turns=2", "env.step_timeout_s=0.1"])
    assert all(t.finish_reason == "abort" and t.reward == 0.0 for t in trajs)
    assert all(t.turn_stats["env_timeout"] == 1.0 and t.turn_stats["env_error"] == 1.0 for t in trajs)
    assert worker.stats()["env_env_timeouts"] == worker.stats()["env_env_errors"] >= len(trajs)
    _, trajs, _ = run_worker(ask, env=SleepyEnv, overrides=["env.max_turns=2", "env.step_timeout_s=5"])
    assert all(t.finish_reason == "length" and t.reward == 0.5 for t in trajs)
    # env.workers: the size of the pool the steps run in (4 trajectories wait on their steps at once)
    for workers, most in ((1, 1), (4, 4)):
        SleepyEnv.most = 0
        run_worker(ask, env=SleepyEnv, overrides=["env.max_turns=2", f"env.workers={workers}"])
        assert (SleepyEnv.most == 1) if most == 1 else (SleepyEnv.most >= 2), (workers, SleepyEnv.most)
