"""Rewards in worker processes: every failure kind counted with its traceback, the limits
(reward.timeout_s, cpu_s, memory_mb, workers) each shown to change the outcome, Math-Verify's
timeout on in the pool, and the driver's watch (console lines, stop past max_error_rate)."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from laminar_jax.config import RewardConfig
from laminar_jax.data import PromptGroup
from laminar_jax.rewards import RewardScorer, resolve_reward
from laminar_jax.rewards.health import RewardFailure, RewardWatch

GRADED = "tests.laminar_jax.rewards.user_rewards:graded"


def scorer(**options) -> RewardScorer:
    cfg = RewardConfig(fn=options.pop("fn", GRADED), **options)
    return RewardScorer(resolve_reward(cfg))


def group(n: int) -> PromptGroup:
    return PromptGroup("e0-0", "p0", "2:", np.array([1]), "2 1", {"answer": "1"}, n, 0, 0)


def score(s: RewardScorer, completions):
    try:
        return s.score_group(group(len(completions)), completions)
    finally:
        s.close()


def kinds(results):
    return [None if r.ok else r.error.kind for r in results]


def test_each_failure_kind_is_counted_with_its_first_traceback_and_the_pool_goes_on():
    s = scorer(timeout_s=2.0, workers=2)
    results = score(s, ["ok", "raise", "nan", "text", "sleep 60", "ok"])
    assert kinds(results) == [None, "raised", "non_finite", "not_a_number", "timeout", None]
    assert [r.value for r in results if r.ok] == [1.0, 1.0]
    assert [r.error.sample_index for r in results if not r.ok] == [1, 2, 3, 4]
    assert s.counts() == dict(calls=6, errors=4, raised=1, non_finite=1, not_a_number=1, timeout=1, crashed=0)
    health = s.health()
    assert (health["window_calls"], health["window_errors"]) == (6, 4)
    first = health["first_errors"]
    assert first["raised"].startswith("Traceback") and "ValueError: bad grader on '2:'" in first["raised"]
    assert "user_rewards.py" in first["raised"]
    assert "reward.timeout_s=2" in first["timeout"] and "returned str '1.0'" in first["not_a_number"]


@pytest.mark.parametrize("timeout_s, kind", [(0.5, "timeout"), (20.0, None)])
def test_timeout_s_bounds_a_call(timeout_s, kind):
    assert kinds(score(scorer(timeout_s=timeout_s), ["sleep 1.5"])) == [kind]


def test_a_reward_processs_start_is_not_the_rewards_time():
    """The module takes 1.5 s to import in each reward process, longer than timeout_s: the
    process's start (up to its ready frame) is not counted, the call is."""
    from tests.laminar_jax.rewards import slow_start_rewards
    s = scorer(fn="tests.laminar_jax.rewards.slow_start_rewards:quick", timeout_s=0.5, workers=1)
    assert slow_start_rewards.IMPORT_S > 0.5
    results = score(s, ["1", "1"])
    assert kinds(results) == [None, None] and [r.value for r in results] == [1.0, 1.0]


def test_a_reward_process_that_does_not_start_in_time_is_a_timeout_that_says_so(monkeypatch):
    from laminar_jax.rewards import pool
    monkeypatch.setattr(pool, "START_TIMEOUT_S", 0.3)
    s = scorer(fn="tests.laminar_jax.rewards.slow_start_rewards:quick", timeout_s=10.0, workers=1)
    results = score(s, ["1"])
    assert kinds(results) == ["timeout"]
    assert "did not start within 0.3 s" in results[0].error.error, results[0].error


@pytest.mark.parametrize("cpu_s, kind", [(1.0, "crashed"), (None, "timeout")])
def test_cpu_s_kills_a_spinning_reward(cpu_s, kind):
    # cpu_s=1 kills the spin long before the 20 s wall timeout; with cpu_s as large as that
    # timeout, the wall clock ends it first
    s = scorer(timeout_s=20.0 if cpu_s else 3.0, cpu_s=cpu_s or 60.0)
    (result,) = score(s, ["spin"])
    assert kinds([result]) == [kind]
    if kind == "crashed":
        assert "SIGXCPU" in result.error.error and "reward.cpu_s" in result.error.error


@pytest.mark.parametrize("memory_mb, kind", [(640, "raised"), (4096, None)])
def test_memory_mb_refuses_a_large_allocation(memory_mb, kind):
    (result,) = score(scorer(memory_mb=memory_mb, timeout_s=20.0), ["alloc 700"])
    assert kinds([result]) == [kind]
    if kind:
        assert result.error.error.startswith("MemoryError")


@pytest.mark.parametrize("fn, workers, processes", [("task", None, 0), ("exact_match", None, 0), ("format", None, 0),
                                                    ("math", None, 2), ("code_exec", None, 2), (GRADED, None, 2),
                                                    ("task", 1, 1), (GRADED, 0, 0)])
def test_workers_null_scores_the_linear_builtins_in_process_and_the_rest_in_two_processes(fn, workers, processes):
    from laminar_jax.rewards.registry import pool_workers
    assert pool_workers(fn, workers) == processes
    row = {"task": "arithmetic", "answer": "1"}
    s = scorer(fn=fn, workers=workers)
    assert s.workers == processes
    if workers is None:   # a reward named by its spec alone follows the same rule
        assert RewardScorer(resolve_reward(fn)).workers == processes
    try:
        pending = s.submit_group(dataclasses.replace(group(2), row=row), ["1", "2"])
        if fn == "task":
            assert [r.value for r in pending.results()] == [1.0, 0.0]
        assert (s._pool is None) == (processes == 0)
        if processes:
            assert s._pool._threads._max_workers == processes
    finally:
        s.close()


def test_reward_workers_is_null_or_at_least_zero():
    assert RewardConfig().workers is None and RewardConfig(workers=0).workers == 0
    with pytest.raises(ValueError, match="workers: expected null or an int >= 0, got -1"):
        RewardConfig(workers=-1)


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_is_the_number_of_reward_processes(workers):
    results = score(scorer(workers=workers, timeout_s=20.0), ["pid"] * 4)
    assert len({r.value for r in results}) == workers


def test_math_verify_timeout_is_on_in_the_pool_and_off_on_a_thread():
    (result,) = score(scorer(), ["timeout?"])
    assert result.value == 5.0  # the pool process's main thread: SIGALRM timeouts work
    from tests.laminar_jax.rewards.user_rewards import graded
    got = []
    t = threading.Thread(target=lambda: got.append(graded("", "timeout?", {})))
    t.start()
    t.join()
    assert got == [-1.0]


def health(calls, errors, kinds_=None, fn="pkg:fn"):
    kinds_ = kinds_ or {"raised": errors}
    return {"reward": {"fn": fn, "calls": calls, "errors": errors, **kinds_, "window_calls": calls,
                       "window_errors": errors,
                       "first_errors": {k: f"Traceback ...\nValueError: {k} here" for k in kinds_}}}


def test_watch_prints_each_kind_once_with_its_traceback():
    watch = RewardWatch(max_error_rate=0.5, error_window=64)
    lines = watch.update([health(10, 2), health(10, 1, {"timeout": 1})])
    assert len(lines) == 2
    assert lines[0].startswith("reward.fn 'pkg:fn': 2 'raised' of 20 completions so far (scored 0); the first:")
    assert "ValueError: raised here" in lines[0] and "'timeout'" in lines[1]
    assert watch.update([health(30, 3), health(30, 1, {"timeout": 1})]) == []  # shown already


@pytest.mark.parametrize("max_error_rate, stops", [(0.5, True), (0.9, False)])
def test_watch_stops_past_max_error_rate_over_a_full_window(max_error_rate, stops):
    watch = RewardWatch(max_error_rate=max_error_rate, error_window=64)
    watch.update([health(40, 40)])  # 100% failing, but fewer than error_window outcomes yet
    watch.check()
    stats = [health(40, 40), health(40, 20)]  # 60 of 80
    if stops:
        with pytest.raises(RewardFailure, match=r"60 of the last 80 completions failed \(75% > "
                                                r"reward.max_error_rate=0.5; raised 60\)"):
            watch.update(stats)
            watch.check()
    else:
        watch.update(stats)
        watch.check()


@pytest.mark.parametrize("error_window, stops", [(64, False), (32, True)])
def test_error_window_is_how_many_outcomes_the_rate_needs(error_window, stops):
    watch = RewardWatch(max_error_rate=0.5, error_window=error_window)
    watch.update([health(40, 40)])
    if stops:
        with pytest.raises(RewardFailure):
            watch.check()
    else:
        watch.check()


def test_scorer_window_keeps_the_last_error_window_outcomes():
    s = scorer(error_window=3, fn="exact_match")
    score(s, ["x", "y", "1", "1"])  # answer "1": two misses are scores (0.0), not errors
    h = s.health()
    assert (h["calls"], h["window_calls"], h["window_errors"]) == (4, 3, 0)
