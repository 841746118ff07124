"""The process's orbax save slot: one holder at a time, released by any thread, timeouts named."""
import threading
import time

import pytest

from laminar_jax import orbax_saves


def test_the_slot_has_one_holder_until_released_from_another_thread():
    first = orbax_saves.acquire("checkpoint 4")
    assert orbax_saves.holder()[0] == "checkpoint 4"
    got = []
    waiter = threading.Thread(target=lambda: got.append(orbax_saves.acquire("publish v5")))
    waiter.start()
    time.sleep(0.2)
    assert not got   # still held
    threading.Thread(target=first.release).start()   # a commit thread gives it back
    waiter.join(10)
    assert got and orbax_saves.holder()[0] == "publish v5"
    got[0].release()
    got[0].release()   # a second release is a no-op: it must not free a slot someone else holds
    held = orbax_saves.acquire("checkpoint 6", timeout_s=1)
    with pytest.raises(TimeoutError, match=r"'publish v7' waited 0 s .* held by 'checkpoint 6'"):
        orbax_saves.acquire("publish v7", timeout_s=0.1)
    held.release()
    assert orbax_saves.holder() is None
    with orbax_saves.acquire("checkpoint 8") as slot:
        assert not slot.released
    assert slot.released and orbax_saves.holder() is None


class _Master:
    def __init__(self):
        self.calls = []
        self.publish = self   # `master.publish.remote(version, path)`

    def remote(self, version, path):
        self.calls.append(version)


def _saves_meet_after_numbering(monkeypatch, wait_s):
    """Makes two orbax saves at once overlap where orbax's process-wide save counter matters (in
    CI this took a long run to hit). The publisher's writer, once its first save has taken its
    number, sets the returned event and waits up to `wait_s` for another save to take one; the
    test's checkpoint thread starts saving on that event. Without a save slot the two saves then
    run their synchronous parts together; with one, the checkpoint waits for the slot and the
    writer loses `wait_s` once."""
    from orbax.checkpoint._src.futures import synchronization

    writer_numbered, meet = threading.Event(), threading.Barrier(2)
    bump = synchronization.OperationIdGenerator.next_operation_id.__func__

    def next_operation_id(cls):
        value = bump(cls)
        first_write = threading.current_thread().name == "publish-writer" and not writer_numbered.is_set()
        if first_write:
            writer_numbered.set()
        if first_write or meet.n_waiting:
            try:
                meet.wait(wait_s)
            except threading.BrokenBarrierError:   # the saves took turns
                pass
        return value

    monkeypatch.setattr(synchronization.OperationIdGenerator, "next_operation_id",
                        classmethod(next_operation_id))
    return writer_numbered


def test_a_checkpoint_and_published_versions_saved_at_once_all_commit_whole(tmp_path, monkeypatch):
    """The learner process: its checkpointer (learner thread) saves while the publisher's writer
    thread saves weight versions. Without one save slot per process, orbax's process-wide save
    counter moves under a save in flight and its commit waits 300 s for a key nobody sets (CI)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    writer_numbered = _saves_meet_after_numbering(monkeypatch, wait_s=2.0)

    from laminar_jax.runtime.checkpoint import Checkpointer
    from laminar_jax.weights import publish
    from laminar_jax.weights.events import EventLog

    log, master = EventLog(), _Master()
    store = publish.WeightStore.local(str(tmp_path / "store"))
    pub = publish.Publisher(store, dtype="float32", master=master, events=log)
    ck = Checkpointer(str(tmp_path / "run"))
    weights = lambda v: {"w": jnp.full((256, 256), float(v)), "b": jnp.full((256,), -float(v))}  # noqa: E731
    errors, done = [], {}

    def run(name, body):
        try:
            body()
            done[name] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append((name, e))

    def publishes():
        for v in range(1, 7):
            pub.publish(v, weights(v))
            time.sleep(0.02)
        pub.wait_until_written(timeout_s=30)

    def checkpoints():
        assert writer_numbered.wait(20)
        for c in range(1, 4):
            ck.save(c, {"params": weights(100 + c), "step": jnp.asarray(c)}, {"version": c})
        assert [r["version"] for r in ck.committed(wait=True)][-1] == 3

    start = time.monotonic()
    threads = [threading.Thread(target=run, args=(n, f), daemon=True)
               for n, f in (("publish", publishes), ("checkpoint", checkpoints))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, start + 30 - time.monotonic()))
    assert not errors, errors
    assert set(done) == {"publish", "checkpoint"}, f"not committed within 30 s: {orbax_saves.holder()}"
    # every announced version is whole and holds what was published as it; the last one landed
    assert master.calls == sorted(master.calls) and master.calls[-1] == 6
    for v in store.versions():
        got = publish.read_version(store, v)
        assert np.all(got["w"] == v) and np.all(got["b"] == -v), v
    assert not log.records("publish_failed")
    like = {"params": weights(0), "step": jnp.asarray(0)}
    for c in (2, 3):   # max_to_keep=2: the last two are kept
        state, meta = ck.restore(c, like)
        assert meta == {"version": c} and int(state["step"]) == c
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                         state["params"], weights(100 + c)))
    assert orbax_saves.holder() is None
    ck.close()
    pub.close()
