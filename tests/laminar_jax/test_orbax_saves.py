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
