"""Start-up of `laminar train` (issue 20): what the driver process imports, and the warm-up
running beside Ray's start (`driver._Background`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_the_driver_imports_no_jax_flax_or_orbax():
    """Only the actors compute: the driver module (and the fleet and learner classes it hands to
    Ray) loads without jax, flax and orbax, seconds of every start-up (the warm-up imports them
    when it runs)."""
    code = ("import json, sys; import laminar_jax.runtime.driver; "
            "print(json.dumps(sorted(m for m in ('jax', 'flax', 'orbax', 'optax') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_background_returns_the_value_raises_the_error_and_times_out():
    from laminar_jax.runtime.driver import _Background

    caller = threading.current_thread()
    ran_in = []
    job = _Background(lambda x: ran_in.append(threading.current_thread()) or x * 2, 21)
    assert job.result(timeout=10) == 42 and ran_in[0] is not caller   # on its own thread

    def boom():
        raise ValueError("sft.seq_len too short")
    with pytest.raises(ValueError, match="seq_len"):
        _Background(boom).result(timeout=10)
    with pytest.raises(TimeoutError, match="warm-up"):
        _Background(time.sleep, 5).result(timeout=0.1)
