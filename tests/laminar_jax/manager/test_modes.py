"""Staleness and admission rules of the scheduling modes (pure functions)."""
import pytest

from laminar_jax.manager import modes


def test_staleness_definition_and_errors():
    assert modes.staleness(5, 3) == 2
    assert modes.staleness(3, 3) == 0
    with pytest.raises(ValueError, match="newer than the consuming learner version"):
        modes.staleness(2, 3)
    with pytest.raises(ValueError, match="learner_version"):
        modes.staleness(-1, 0)


def test_bounds_per_mode():
    assert modes.staleness_bound("sync") == 0
    assert modes.staleness_bound("one_step", max_staleness=7) == 1
    assert modes.staleness_bound("stream") == 1
    assert modes.staleness_bound("stream", max_staleness=3) == 3
    assert modes.staleness_bound("partial") is None
    assert modes.staleness_bound("partial", max_staleness=4) == 4
    assert modes.staleness_bound("laminar", max_staleness=4) is None
    with pytest.raises(ValueError, match="mode: expected one of"):
        modes.staleness_bound("async")


def test_may_start_batch_window():
    # batch k on version v: allowed iff 0 <= k - v <= bound
    allowed = {(k, v) for k in range(6) for v in range(6) if modes.may_start_batch(k, v, bound=1)}
    assert allowed == {(k, v) for k in range(6) for v in range(6) if v in (k - 1, k)}
    assert modes.batch_gen_version(5, bound=1) == 4
    assert modes.batch_gen_version(0, bound=3) == 0


def test_may_submit_keeps_staleness_within_eta():
    # every submission allowed at learner version i lands in a batch consumed at version >= its
    # index, so staleness <= eta when generated on version i
    b, eta = 4, 2
    for i in range(5):
        n = 0
        while modes.may_submit(n, i, batch_size=b, eta=eta):
            n += 1
        assert n == (i + eta + 1) * b
        assert modes.batch_of(n - 1, b) - i <= eta
    assert modes.may_submit(10 ** 9, 0, batch_size=4, eta=None)


def test_fresh_issue_limit_closed_forms():
    # one_step, batch of 4, weights v=2: batches 2 and 3 may go out -> positions 8..15
    assert modes.fresh_issue_limit("one_step", next_position=8, weight_version=2,
                                   learner_version=2, global_batch=4, max_staleness=None) == 8
    assert modes.fresh_issue_limit("one_step", next_position=13, weight_version=2,
                                   learner_version=2, global_batch=4, max_staleness=None) == 3
    assert modes.fresh_issue_limit("sync", next_position=4, weight_version=2,
                                   learner_version=2, global_batch=4, max_staleness=None) == 0
    assert modes.fresh_issue_limit("partial", next_position=5, weight_version=0,
                                   learner_version=1, global_batch=4, max_staleness=1) == 7
    assert modes.fresh_issue_limit("laminar", next_position=5, weight_version=0,
                                   learner_version=1, global_batch=4, max_staleness=1) is None


def test_pull_and_refill_rules():
    assert modes.may_pull_weights("partial", in_flight=10)
    for mode in ("sync", "one_step", "stream", "laminar"):
        assert modes.may_pull_weights(mode, in_flight=0)
        assert not modes.may_pull_weights(mode, in_flight=3)
        assert modes.may_pull_weights(mode, in_flight=3, released=True)
    assert [m for m in modes.MODES if modes.refills_continuously(m)] == ["partial"]
    assert [m for m in modes.MODES if modes.interrupts_on_publish(m)] == ["partial"]
    assert [m for m in modes.MODES if modes.streams_minibatches(m)] == ["stream"]
    assert [m for m in modes.MODES if modes.uses_global_batches(m)] == ["sync", "one_step", "stream"]
    assert modes.repacks("laminar", enabled=True) and not modes.repacks("laminar", enabled=False)
    assert not modes.repacks("partial", enabled=True)
