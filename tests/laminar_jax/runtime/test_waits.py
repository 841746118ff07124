"""Waits instead of polling, on real Ray actors:

- the data actor's `wait_sample` blocks the learner in its own concurrency group while deliveries
  go through the default one, returns the groups as soon as they are there, and [] at its timeout;
- `RelaySource` (a rollout's view of its node's relay, a real RelayGroup with a real publisher)
  answers `newer_than` without calling the relay while nothing newer is served (one long-poll per
  version instead), and `wait_newer` returns a version as soon as it is served, with the bytes
  the relay serves, mapped from the buffer the long-poll named (no second call; a replaced one
  is not read).
"""
import threading
import time

import numpy as np
import pytest
import ray
from flax import nnx

from laminar_jax.data.records import PromptRow, Trajectory
from laminar_jax.runtime.data_actor import CONCURRENCY_GROUPS, DataActor
from laminar_jax.runtime.weights_source import RelaySource

pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
GROUP = 2


def _data_actor(**options):
    rows = [PromptRow(f"q{i}", f"p{i}", "x", {"i": i}) for i in range(8)]
    return DataActor(dict(rows=rows, group_size=GROUP, shuffle=False, encode=lambda s: [1, 2, 3]),
                     dict(capacity_groups=16), mode="laminar", global_batch=2, max_staleness=None)


def _trajectories(g):
    return [Trajectory(g.group_id, g.prompt_id, i, "r0", np.asarray(g.prompt_tokens), np.asarray([5, 6]),
                       np.zeros(2, np.float32), np.zeros(2, np.float32), np.zeros(2, np.int64), 0, 1.0, "stop")
            for i in range(GROUP)]


def test_wait_sample_in_process_wakes_on_delivery_and_times_out():
    data = _data_actor()
    groups = data.issue(2, "r0", 0)
    t0 = time.monotonic()
    assert data.wait_sample(1, 0, None, 0.2) == [] and time.monotonic() - t0 >= 0.2
    threading.Timer(0.3, lambda: data.deliver(_trajectories(groups[0]))).start()
    t0 = time.monotonic()
    got = data.wait_sample(1, 0, None, 10.0)
    assert [g[0].group_id for g in got] == [groups[0].group_id] and time.monotonic() - t0 < 5.0


def test_wait_sample_on_the_actor_lets_deliveries_through(cluster):
    actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(DataActor).options(num_cpus=0, max_concurrency=1)
    rows = [PromptRow(f"q{i}", f"p{i}", "x", {"i": i}) for i in range(8)]
    data = actor.remote(dict(rows=rows, group_size=GROUP, shuffle=False, encode=lambda s: [1, 2, 3]),
                        dict(capacity_groups=16), mode="laminar", global_batch=2, max_staleness=None)
    groups = ray.get(data.issue.remote(2, "r0", 0), timeout=60)
    waiting = data.wait_sample.remote(2, 0, None, 60.0)
    time.sleep(0.5)
    assert ray.wait([waiting], timeout=0)[0] == []          # blocked: nothing buffered yet
    t0 = time.monotonic()
    for g in groups:   # the default group is not blocked by the wait
        assert ray.get(data.deliver.remote(_trajectories(g)), timeout=10)
    got = ray.get(waiting, timeout=30)
    assert sorted(g[0].group_id for g in got) == sorted(g.group_id for g in groups)
    assert time.monotonic() - t0 < 10.0
    assert ray.get(data.wait_sample.remote(1, 0, None, 0.2), timeout=30) == []
    ray.kill(data)


def test_relay_source_long_polls_instead_of_polling(cluster, tmp_path):
    from laminar_jax.models.config import DecoderConfig
    from laminar_jax.models.decoder import Decoder
    from laminar_jax.weights import flat, publish
    from laminar_jax.weights.relay import pull
    from laminar_jax.weights.relay_group import RelayGroup

    cfg = DecoderConfig.preset("tiny")
    head = ray.get_runtime_context().get_node_id()
    store = publish.WeightStore(str(tmp_path / "store"), node_id=head, shared=False)
    pub = publish.Publisher(store, dtype="float32")
    group = RelayGroup(cfg, store, publisher=pub, nodes=[head], prefix="waits", num_chunks=2,
                       runtime_env={"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}})
    try:
        source = RelaySource("waits")
        assert source.newer_than(-1) is None
        time.sleep(0.3)
        rpcs = source.rpcs
        for _ in range(200):                      # a rollout's loop turns: no relay call
            assert source.newer_than(-1) is None
        assert source.rpcs - rpcs <= 1            # at most the watcher's next long-poll
        params = nnx.to_pure_dict(nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)[1])
        threading.Timer(0.5, lambda: pub.publish(1, params)).start()
        t0 = time.monotonic()
        got = source.wait_newer(-1, 120.0)
        assert got is not None and got[0] == 1 and time.monotonic() - t0 < 60
        version, buffer, index = pull(group.relay_for(head))
        want = flat.unflatten(buffer, index)
        assert set(got[1]) == set(want) and all(np.array_equal(got[1][k], want[k]) for k in want)
        # the rollout mapped the buffer the watcher's long-poll named: no second relay call
        assert source.pull_rpcs == 0
        assert source.newer_than(1) is None and source.wait_newer(1, 0.2) is None
        # a snapshot the relay has replaced since (its buffer released) is not read: the pull
        # asks the relay for its newest instead
        seen = source._seen
        pub.publish(2, params)
        got = source.wait_newer(1, 120.0)
        assert got is not None and got[0] == 2 and source.pull_rpcs == 0
        source._seen = seen
        assert source._pull(0)[0] == 2 and source.pull_rpcs == 1
    finally:
        pub.close()
        group.shutdown()



class _Unanswered:
    """A data actor's method whose answer never comes: each call is a real Ray task that no node
    can run (it asks for a resource none has), so its ObjectRef never resolves; no process is
    started for it, and the refs are cancelled afterwards."""

    def __init__(self):
        self.refs = []
        self._task = ray.remote(resources={"no-node-has-this": 1})(lambda *args: [])

    def remote(self, *args):
        self.refs.append(self._task.remote(*args))
        return self.refs[-1]


class _Tok:
    stop_token_ids = (0,)


class _Engine:
    weight_version = 3

    def has_unfinished(self):
        return False


def test_a_rollout_whose_data_actor_does_not_answer_fails_naming_the_call(cluster, monkeypatch):
    from types import SimpleNamespace

    from laminar_jax.config import load_config
    from laminar_jax.weights.source import WeightSource
    from rollout import worker as W

    issue = _Unanswered()
    worker = W.RolloutWorker("r0", load_config("configs/default.yaml", []), SimpleNamespace(issue=issue),
                             WeightSource(), lambda t, v: None, _Tok(), reward=None)
    worker.engine = _Engine()
    monkeypatch.setattr(W, "DATA_CALL_TIMEOUT_S", 0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"rollout r0: the data actor's issue\(\) did not answer within 0.3 s"):
            worker._take()
        assert len(issue.refs) == 1 and time.monotonic() - t0 < 10
    finally:
        for ref in issue.refs:
            ray.cancel(ref)
