"""Compile turns: processes of one machine compile a program once (laminar_jax.compile_turns)."""
import json
import os
import subprocess
import sys
import threading
import time

from laminar_jax import compile_turns

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_turn_is_exclusive_per_key_and_bounded(tmp_path):
    order = []

    def hold(name, key, hold_s):
        with compile_turns.turn(str(tmp_path), key) as held:
            order.append((name, "in", held))
            time.sleep(hold_s)
            order.append((name, "out", held))

    first = threading.Thread(target=hold, args=("a", "prefill", 0.4))
    first.start()
    time.sleep(0.1)
    hold("b", "prefill", 0.0)   # waits for a's turn
    first.join()
    assert order == [("a", "in", True), ("a", "out", True), ("b", "in", True), ("b", "out", True)]
    # another key does not wait; a full wait gives up and goes on without the turn
    with compile_turns.turn(str(tmp_path), "decode") as held:
        assert held
        t0 = time.monotonic()
        with compile_turns.turn(str(tmp_path), "decode", wait_s=0.2) as again:
            assert not again and 0.2 <= time.monotonic() - t0 < 2.0
        with compile_turns.turn(str(tmp_path), "prefill", wait_s=0.0) as other:
            assert other
    with compile_turns.turn(None, "x") as none:
        assert not none


_ENGINE = """
import json, sys, time
import jax
from jax import monitoring
misses = []
monitoring.register_event_listener(lambda name, **kw: misses.append(name) if name.endswith("cache_misses") else None)
sys.path.insert(0, {repo!r})
from laminar_jax.runtime import compile_cache
compile_cache.enable({cache!r})
from rollout import engine as E
from rollout.jax_engine import JaxEngine
from tests.rollout.rollout_fixtures import JAX_ENGINE_KW, prompt
engine = JaxEngine.from_pretrained({model!r}, compile_turns={turns!r}, **JAX_ENGINE_KW)
built = len(misses)
open({go!r} + "." + str(__import__("os").getpid()), "w").close()   # built
while not __import__("os").path.exists({go!r}):   # both processes generate at once
    time.sleep(0.01)
engine.add([E.Request(f"r{{i}}", prompt(i, 5 + 7 * i), E.SamplingParams(max_new_tokens=20, seed=i)) for i in range(3)])
out = {{}}
while engine.has_unfinished():
    out.update((c.request_id, c.response_tokens.tolist()) for c in engine.step())
print(json.dumps({{"misses": len(misses) - built, "tokens": out}}))
"""


def test_two_engines_compile_their_programs_once(tmp_path):
    """Two engine processes on one fresh cache, generating at the same moment: the one that
    waits for its turns loads every program the other compiled (no cache miss of its own)."""
    from tests.rollout.rollout_fixtures import make_checkpoint
    model = make_checkpoint(str(tmp_path / "model"))
    cache, go = str(tmp_path / "cache"), str(tmp_path / "go")
    code = _ENGINE.format(repo=REPO, cache=cache, model=model, turns=os.path.join(cache, "turns"), go=go)
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    deadline = time.monotonic() + 240
    while len([f for f in os.listdir(tmp_path) if f.startswith("go.")]) < 2:   # both built
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "an engine did not build"
        time.sleep(0.05)
    open(go, "w").close()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    misses = sorted(r["misses"] for r in results)
    assert misses[0] == 0 and misses[1] >= 2, misses   # prefill and decode: compiled by one process only
    assert results[0]["tokens"] == results[1]["tokens"]
