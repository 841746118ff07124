"""The code sandbox: the four attacks of the issue (an endless loop, a fork bomb, a 10 GB
allocation, a socket connect to a real listener) are each refused and reported; the code gets a
folder of its own and cannot write outside it; `code_exec` scores programs through it, inside
the reward pool, with reward.code_timeout_s."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile

import numpy as np
import pytest

from laminar_jax.config import RewardConfig
from laminar_jax.data import PromptGroup
from laminar_jax.rewards import RewardScorer, resolve_reward
from laminar_jax.rewards.code import code_exec_reward, last_code_block
from laminar_jax.rewards.sandbox import run_code


@pytest.fixture
def listener():
    """A real socket on loopback: connecting to it works from here, so a refusal is the sandbox's."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    socket.create_connection(srv.getsockname(), timeout=2).close()
    yield srv.getsockname()[1]
    srv.close()


ATTACKS = {
    "endless-loop": ("while True:\n    pass\n", dict(timeout_s=10, cpu_s=1), "cpu_limit", "CPU limit of 1 s"),
    "fork-bomb": ("import os\nwhile True:\n    os.fork()\n", dict(timeout_s=10), "process_limit",
                  "max_procs=16"),
    "10GB-allocation": ("x = bytearray(10 * 1024 ** 3)\n", dict(timeout_s=10), "memory_limit", "memory_mb=512"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attacks_are_refused_and_reported(name):
    code, kw, status, detail = ATTACKS[name]
    result = run_code(code, **kw)
    assert (result.status, result.ok) == (status, False), result
    assert detail in result.detail


def test_socket_connect_is_refused(listener):
    result = run_code(f"import socket\nsocket.create_connection(('127.0.0.1', {listener}), timeout=2)\n")
    assert result.status == "network_blocked" and "Network is unreachable" in result.detail


def test_wall_timeout_kills_a_sleeper():
    result = run_code("import time\ntime.sleep(60)\n", timeout_s=1)
    assert result.status == "timeout" and "timeout_s=1" in result.detail


def test_own_folder_and_nothing_written_outside():
    # a folder outside /tmp (the sandbox has its own /tmp), writable by its owner only
    folder = tempfile.mkdtemp(prefix=".sandbox-probe-", dir=os.path.dirname(os.path.abspath(__file__)))
    outside = os.path.join(folder, "outside.txt")
    try:
        os.chmod(folder, 0o755)
        result = run_code(f"import os\nopen('mine.txt', 'w').write('x')\nprint(sorted(os.listdir('.')))\n"
                          f"open('/tmp/sandbox-escape-probe', 'w').write('x')\n"
                          f"open({outside!r}, 'w').write('x')\n")
        assert "['main.py', 'mine.txt']" in result.stdout
        assert not os.path.exists("/tmp/sandbox-escape-probe")  # the sandbox's /tmp is its own
        if os.geteuid() == 0:  # dropped to nobody, who may not write the folder; a folder under
            # /tmp (a checkout in a temp dir) is not even visible: the sandbox's /tmp is its own
            assert result.status == "error" and ("PermissionError" in result.detail
                                                 or "FileNotFoundError" in result.detail), result.detail
            assert not os.path.exists(outside)
    finally:
        shutil.rmtree(folder)


PROGRAM = "```python\nprint(int(input()) * 2)\n```"


def test_code_exec_scores_the_last_block_against_io_cases_and_asserts():
    row = {"answer": [{"input": "2", "output": "4"}, {"input": "5", "output": "10"}, {"input": "1", "output": "3"}]}
    assert last_code_block("first ```python\nx=1\n``` then " + PROGRAM) == "print(int(input()) * 2)\n"
    assert code_exec_reward("", PROGRAM, row) == pytest.approx(2 / 3)
    asserts = {"answer": "def f(x):\n    return x + 1\n"}
    code = "```python\nassert 1 + 1 == 2\n```"
    assert code_exec_reward("", code, asserts) == 1.0
    assert code_exec_reward("", "```python\nraise SystemExit(3)\n```", asserts) == 0.0
    assert code_exec_reward("", "no code here", row) == 0.0
    with pytest.raises(ValueError, match="must be a string of asserts"):
        code_exec_reward("", PROGRAM, {"answer": 7})


@pytest.mark.parametrize("code_timeout_s, value", [(1.0, 0.0), (10.0, 1.0)])
def test_code_exec_in_the_pool_uses_code_timeout_s(code_timeout_s, value):
    """From `reward.fn: code_exec` as a run resolves it: pool process -> sandbox subprocess."""
    cfg = RewardConfig(fn="code_exec", code_timeout_s=code_timeout_s, timeout_s=20.0)
    s = RewardScorer(resolve_reward(cfg))
    g = PromptGroup("e0-0", "p0", "", np.array([1]), "", {"answer": [{"input": "", "output": "done"}]}, 1, 0, 0)
    try:
        (result,) = s.score_group(g, ["```python\nimport time\ntime.sleep(2)\nprint('done')\n```"])
    finally:
        s.close()
    assert result.ok and result.value == value


@pytest.mark.parametrize("code_memory_mb, value", [(64, 0.0), (512, 1.0)])
def test_code_memory_mb_is_the_sandbox_address_space(code_memory_mb, value):
    code = "```python\nx = bytearray(100 * 1024 * 1024)\nprint('ok')\n```"
    row = {"answer": [{"input": "", "output": "ok"}]}
    assert code_exec_reward("", code, row, sandbox={"memory_mb": code_memory_mb, "timeout_s": 10}) == value
