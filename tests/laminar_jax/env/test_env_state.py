"""Environment snapshots (laminar_jax/env/protocol.py): a built-in env's state between steps
round-trips through JSON into a fresh env, which then answers every later step as the original
does (the tool-call limit included); a snapshot that is not JSON data, or a restore that fails,
raises an error naming the env; a partial record carries its episode through the pool's JSON
state."""
import json

import numpy as np
import pytest

from laminar_jax.data.partial_pool import PartialPool
from laminar_jax.data.records import PartialTrajectory
from laminar_jax.env.lookup import LookupEnv, call_text
from laminar_jax.env.protocol import EnvStateError, can_snapshot, restore_env, snapshot_state


class Cfg:
    max_tool_calls, tool_timeout_s = 2, 5.0


ROW = {"key": 37, "value": 5}


def test_a_lookup_env_snapshot_round_trips_and_the_restored_env_answers_the_same():
    env = LookupEnv(Cfg())
    env.reset(ROW)
    first = env.step(call_text(37))
    assert first.observation == "5" and env.calls == 1
    state = snapshot_state(env, "lookup")
    assert state == {"calls": 1} and json.loads(json.dumps(state)) == state
    later = [call_text(37) + call_text(11), call_text(37), "5"]
    fresh = LookupEnv(Cfg())
    restore_env(fresh, "lookup", ROW, state)
    assert snapshot_state(fresh, "lookup") == state
    for text in later:   # the second call of the first text hits max_tool_calls=2: the count moved
        assert fresh.step(text) == env.step(text), text
    restarted = LookupEnv(Cfg())   # a reset instead of a restore forgets the call made
    restarted.reset(ROW)
    kept, lost = LookupEnv(Cfg()), restarted.step(later[0])
    restore_env(kept, "lookup", ROW, state)
    assert "limit of 2" in kept.step(later[0]).observation and "limit" not in lost.observation


def test_snapshots_that_are_no_json_or_fail_to_restore_name_the_env():
    class Odd(LookupEnv):
        def snapshot(self):
            return {"calls": self.calls, "tools": self._tools}   # objects, not data

    env = Odd(Cfg())
    env.reset(ROW)
    with pytest.raises(EnvStateError, match="env 'my.envs:Odd': snapshot\\(\\) is not JSON data"):
        snapshot_state(env, "my.envs:Odd")
    with pytest.raises(EnvStateError, match="env 'lookup': restore\\(\\) of a snapshot raised ValueError"):
        restore_env(LookupEnv(Cfg()), "lookup", ROW, {"calls": "two"})

    class Plain:
        def reset(self, row):
            return []

        def step(self, text):
            return None, 0.0, True, {}

    assert not can_snapshot(Plain()) and can_snapshot(LookupEnv(Cfg()))
    with pytest.raises(EnvStateError, match="env 'plain': Plain has no snapshot"):
        restore_env(Plain(), "plain", ROW, {})


def test_a_partial_record_carries_its_episode_through_the_pool_state():
    episode = {"format": 1, "phase": "step", "turns": 1, "env": {"calls": 1},
               "messages": [{"role": "user", "content": "37?"}]}
    p = PartialTrajectory("e0-0", 0, "r0", np.arange(3), np.arange(4), np.zeros(4), np.zeros(4), np.zeros(4, np.int64),
                          loss_mask=np.array([1, 1, 0, 0]), episode=episode)
    pool = PartialPool()
    pool.update([p])
    state = json.loads(json.dumps(pool.state_dict()))
    again = PartialPool()
    again.load_state_dict(state)
    (q,) = again.get()
    assert q.episode == episode and q.loss_mask.tolist() == [1, 1, 0, 0]
    assert q.moved_to("r1").episode == episode
    with pytest.raises(ValueError, match="partial e0-0/0: episode must be a mapping"):
        PartialTrajectory("e0-0", 0, "r0", [1], [], [], [], [], episode="calls=1")
