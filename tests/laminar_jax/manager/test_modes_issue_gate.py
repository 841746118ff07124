"""The issue gate of bounded-staleness producers: `modes.issue_bound`, `modes.bounded_issue_limit`."""
import pytest

from laminar_jax.manager import modes


def test_issue_bound_per_mode():
    assert modes.issue_bound("laminar", max_staleness=None) is None     # observed (the paper)
    assert modes.issue_bound("laminar", max_staleness=4) == 4
    assert modes.issue_bound("partial", max_staleness=None) is None     # eta = inf
    assert modes.issue_bound("partial", max_staleness=3) == 3
    assert modes.issue_bound("one_step", max_staleness=None) == 1
    with pytest.raises(ValueError, match="mode"):
        modes.issue_bound("nope", max_staleness=1)


@pytest.mark.parametrize("bound", [0, 1, 4])
def test_bounded_issue_limit_closed_form_and_areal_rule(bound):
    B = 8
    for version in range(4):
        for pos in range(0, 60, 3):
            limit = modes.bounded_issue_limit(next_position=pos, weight_version=version,
                                              global_batch=B, bound=bound)
            assert limit == max(0, (version + bound + 1) * B - pos)
            # AReaL's may_submit allows exactly the next `limit` submissions
            allowed = 0
            while modes.may_submit(pos + allowed, version, batch_size=B, eta=bound):
                allowed += 1
            assert allowed == limit
    assert modes.bounded_issue_limit(next_position=5, weight_version=0, global_batch=B,
                                     bound=None) is None
    with pytest.raises(ValueError, match="global_batch"):
        modes.bounded_issue_limit(next_position=0, weight_version=0, global_batch=0, bound=1)
