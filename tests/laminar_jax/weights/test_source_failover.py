"""A rollout during a master failover: the dead master took the version it was broadcasting with
it, the store already holds it, and the new master restores it in about a broadcast. A rollout
that started a batch on its old weights meanwhile would keep them for that whole batch (laminar
mode loads between batches), which is where the rollout side of a failover lost its time -- on
the dead master's node and on the surviving relay's alike. So `RelaySource.catching_up` says
"wait" exactly while the store holds a version newer than both the rollout's and the relays'
newest, for at most FAILOVER_GRACE_S per version; the worker takes no new work while it says
so. The real run (a real kill, real relays) is the short chaos test's master fault
(tests/laminar_jax/runtime/test_chaos.py)."""
import time

from laminar_jax.config import load_config
from laminar_jax.weights import source as S
from rollout import worker as W


class Store(S.WeightSource):
    """The weight store's listing only (what catching_up reads)."""

    def __init__(self, newest):
        self.newest, self.listings = newest, 0

    def newest_published(self):
        self.listings += 1
        return self.newest


def _source(newest, *, served=5):
    src = S.RelaySource("p", fallback=Store(newest))
    src._served = served
    return src


def test_catching_up_while_a_published_version_is_unserved_for_at_most_the_grace(monkeypatch):
    assert _source(6).catching_up(5)                                       # v6 published, relays serve v5
    assert not _source(5).catching_up(5)                                   # nothing newer published
    assert not _source(6, served=6).catching_up(5)                         # a relay serves v6: pull it
    assert not _source(6).catching_up(6)                                   # the rollout has it
    assert not _source(None).catching_up(5)                                # empty / unreadable store
    assert not S.RelaySource("p").catching_up(5)                           # no store to ask
    assert not S.WeightSource().catching_up(5)
    src, now = _source(6), [1000.0]
    monkeypatch.setattr(S.time, "monotonic", lambda: now[0])
    assert src.catching_up(5)
    now[0] += S.FAILOVER_GRACE_S - 0.1
    assert src.catching_up(5)
    now[0] += 0.2                                                          # v6 never came: go on
    assert not src.catching_up(5)
    src.fallback.newest = 7                                                # v7: a grace of its own
    assert src.catching_up(5)


class _Engine:
    weight_version = 5

    def has_unfinished(self):
        return False


class _Data:
    def __init__(self):
        self.issues = 0

    def issue(self, n, rid, version):
        self.issues += 1
        return []


class _Source(S.WeightSource):
    def __init__(self):
        self.waiting = True

    def newer_than(self, version):
        return None

    def catching_up(self, version):
        return self.waiting


class _Tok:
    stop_token_ids = (0,)


def test_worker_takes_no_new_work_while_its_source_catches_up():
    cfg = load_config("configs/default.yaml", ["manager.mode=laminar"])
    data, src = _Data(), _Source()
    worker = W.RolloutWorker("r0", cfg, data, src, lambda t, v: None, _Tok(), reward=None)
    worker.engine = _Engine()
    worker._tick()
    assert data.issues == 0 and worker.counters["catch_up_waits"] == 1
    src.waiting = False
    worker._last_poll = 0.0
    worker._tick()
    assert data.issues == 1


def test_the_watcher_retries_at_once_the_relay_that_did_not_fail():
    # this node's relay failed: another node's at once, this node's again at once, then every retry_s
    assert [S.retry_plan(n, False, 2.0) for n in (1, 2, 3)] == [(True, S.FAILOVER_RETRY_S), (False, S.FAILOVER_RETRY_S),
                                                                (False, 2.0)]
    # another node's relay failed (a master dying while this node's relay is back): home at once.
    # Before, the first retry avoided home here too, found no third relay, and waited retry_s.
    assert [S.retry_plan(n, True, 2.0) for n in (1, 2, 3)] == [(False, S.FAILOVER_RETRY_S), (False, S.FAILOVER_RETRY_S),
                                                               (False, 2.0)]
