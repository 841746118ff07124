"""The learner's close order (runtime/learner_actor.py): the actor is threaded, and the driver
stops with a step in flight when it stops on an error or a hook (the chaos run). close() used to
close orbax under that step, which then saved into the closed checkpoint manager ("cannot
schedule new futures after shutdown" from orbax's background thread, at the end of real runs).

A real Learner in-process (no Ray: its data actor stands in), real orbax: close() called while
a step is inside its update waits for the step, which ends before publishing; nothing is saved
or written after close, and orbax logs no error."""
import logging
import os
import threading

import pytest

from laminar_jax.config import load_config
from tests.laminar_jax.runtime.runtime_fixtures import toy_groups


class _Data:
    """The data actor's calls a step makes after its update (ray.get is the identity here)."""

    class _Call:
        def __init__(self, value):
            self.value = value

        def remote(self, *args, **kwargs):
            return self.value

    def __init__(self):
        self.set_learner_version = self._Call(None)
        self.state_dict = self._Call({})


def test_close_during_a_step_waits_for_it_and_nothing_is_saved_after(tmp_path, monkeypatch, caplog):
    from laminar_jax.runtime import learner_actor
    from laminar_jax.runtime.learner_actor import Learner

    # run.steps=1: the step in flight reaches the final version, so it would publish and save
    cfg = load_config("configs/default.yaml", [
        "learner.global_batch_groups=2", "data.group_size=4", "learner.precompile=false", "run.steps=1",
        "learner.max_seq_len=32", "learner.min_bucket=16", f"relay.store_dir={tmp_path}/stores"])
    run_dir = tmp_path / "run"
    learner = Learner(cfg, str(run_dir), data=_Data(), resume=False, store_root=str(tmp_path / "store"))
    monkeypatch.setattr(learner_actor.ray, "get", lambda x, timeout=None: x)
    groups = toy_groups()
    in_update, release = threading.Event(), threading.Event()
    update = learner._update

    def gated_update(*args):
        in_update.set()
        assert release.wait(60)
        return update(*args)
    monkeypatch.setattr(learner, "_collect", lambda n: (groups, None, 0.0))   # (groups, host ticket, wait s)
    monkeypatch.setattr(learner, "_update", gated_update)

    out: dict = {}

    def run(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - asserted below
            out[name] = e
    caplog.set_level(logging.ERROR)
    stepping = threading.Thread(target=run, args=("step", learner.step))
    stepping.start()
    assert in_update.wait(120)
    closing = threading.Thread(target=run, args=("close", learner.close))
    closing.start()
    closing.join(1.0)
    assert closing.is_alive(), "close() must wait for the step in flight"
    release.set()
    stepping.join(120)
    closing.join(120)
    assert not stepping.is_alive() and not closing.is_alive()
    assert out["step"] is None, out["step"]          # ended before its publish: nobody reads it
    assert isinstance(out["close"], list), out["close"]
    assert learner.version == 0
    assert not (run_dir / "checkpoints" / "1").exists()
    assert not os.path.exists(learner.store.root)   # close removed the store; nothing re-created it
    assert learner.publisher.latest_written is None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
    with pytest.raises(learner_actor.LearnerClosed):   # and a later publish is refused
        learner._check_open()
    assert learner.step() is None
