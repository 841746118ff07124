"""Rewards in worker processes, off the rollout's decode loop.

`RewardPool(reward, workers=2, timeout_s=10, cpu_s=10, memory_mb=4096)` keeps `workers` child
processes (`python -m laminar_jax.rewards.pool`), each holding the resolved reward; `submit(prompt,
completion, row)` returns a `concurrent.futures.Future` of a `Outcome`. A child runs each call on
its main thread (so Math-Verify's SIGALRM timeouts work), under

    RLIMIT_AS  = memory_mb               (an allocation beyond it is a MemoryError: "raised")
    RLIMIT_CPU = CPU used so far + cpu_s  (per call; beyond it the kernel kills the child: "crashed")

(this module runs as `__main__` there, so answers are plain tuples) and the parent waits at most `timeout_s` for the answer, then kills the child ("timeout") and
starts a fresh one for the next call. A child's own start (Python, the reward's imports) is not
part of `timeout_s`: it says it is ready with a first frame, and a child not ready within
START_TIMEOUT_S is a "timeout" too (on a loaded machine a start took seconds, and a 2 s reward
timeout read it as the reward's). Children start at their first call: started while the rollout
waited for its first weights, they took CPU from the learner's init and start-up did not gain
(bench_startup, stop 38: warm 10.0 -> 10.3 s, cold 15.6 -> 16.9 s, interleaved). Frames on the
child's stdin / a private copy of its stdout are 4-byte lengths + pickle, between this process and
its own child only (nothing from a socket or a file); the child's fd 1 is pointed at stderr so a reward's prints cannot corrupt a frame.
"""
from __future__ import annotations

import concurrent.futures
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

_LEN = struct.Struct(">I")
START_TIMEOUT_S = 120.0   # a child's start, up to its ready frame (not part of reward.timeout_s)
READY = "ready"


@dataclass(frozen=True)
class Outcome:
    """One call's result: value (a finite float) or kind + message + traceback."""

    value: float | None
    kind: str | None = None      # raised | non_finite | not_a_number | timeout | crashed
    message: str = ""
    traceback: str = ""


class _Dead(Exception):
    """The child died or stopped answering."""


def _write(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    out = b""
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise _Dead("end of stream")
        out += chunk
    return out


def _read(fd: int, deadline: float | None = None):
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size, deadline))
    return pickle.loads(_read_exact(fd, n, deadline))


class _Child:
    """One worker process and its pipes."""

    def __init__(self, reward, memory_mb: int, cpu_s: float):
        env = dict(os.environ)
        # Whatever the parent can import (a user's reward module), the child can too.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self.proc = subprocess.Popen([sys.executable, "-m", "laminar_jax.rewards.pool"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        _write(self.proc.stdin, {"reward": reward, "memory_mb": memory_mb, "cpu_s": cpu_s})
        self.ready = False

    def call(self, args: tuple, timeout_s: float) -> Outcome:
        try:
            if not self.ready:   # its start is not the reward's time (module docstring)
                try:
                    _read(self.proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S)   # READY
                except TimeoutError:
                    raise TimeoutError(f"the reward process did not start within {START_TIMEOUT_S:g} s") from None
                self.ready = True
            _write(self.proc.stdin, args)
            return Outcome(*_read(self.proc.stdout.fileno(), time.monotonic() + timeout_s))
        except (BrokenPipeError, _Dead):
            code = self.proc.wait()
            raise _Dead(_describe_exit(code)) from None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def _describe_exit(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        why = {"SIGXCPU": "its CPU limit (reward.cpu_s)", "SIGKILL": "a kill (out of memory?)"}.get(name, name)
        return f"the reward process died of {name}: {why}"
    return f"the reward process exited with code {code}"


class RewardPool:
    """`workers` reward processes; `submit(...)` -> Future[Outcome] (module docstring)."""

    def __init__(self, reward, *, workers: int = 2, timeout_s: float = 10.0, cpu_s: float = 10.0,
                 memory_mb: int = 4096):
        self.reward, self.timeout_s, self.cpu_s, self.memory_mb = reward, timeout_s, cpu_s, memory_mb
        self._idle: queue.Queue = queue.Queue()
        for _ in range(workers):
            self._idle.put(None)  # started on first use
        self._threads = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="reward")
        self._children: set = set()
        self._lock = threading.Lock()

    def submit(self, prompt: str, completion: str, row) -> concurrent.futures.Future:
        return self._threads.submit(self._run, (prompt, completion, dict(row or {})))

    def _run(self, args: tuple) -> Outcome:
        child = self._idle.get()
        try:
            if child is None:
                child = _Child(self.reward, self.memory_mb, self.cpu_s)
                with self._lock:
                    self._children.add(child)
            return child.call(args, self.timeout_s)
        except TimeoutError as e:
            self._drop(child)
            child = None
            return Outcome(None, "timeout", f"{str(e) or f'no result within reward.timeout_s={self.timeout_s:g} s'}; "
                                            "the reward process was killed")
        except _Dead as e:
            self._drop(child)
            child = None
            return Outcome(None, "crashed", str(e))
        finally:
            self._idle.put(child)

    def _drop(self, child) -> None:
        child.kill()
        with self._lock:
            self._children.discard(child)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            children, self._children = list(self._children), set()
        for child in children:
            child.kill()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# ---------------------------------------------------------------------- the child process
def _child_main() -> None:
    import resource
    import traceback

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the reward's prints go to stderr, never into a frame
    stdin = sys.stdin.buffer.fileno()
    setup = _read(stdin)
    mem = setup["memory_mb"] * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mem if hard == resource.RLIM_INFINITY else min(mem, hard), hard))
    reward = setup["reward"]
    from laminar_jax.rewards.registry import check_value
    _write(out, READY)
    while True:
        try:
            prompt, completion, row = _read(stdin)
        except _Dead:
            return
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = int(used + setup["cpu_s"]) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        try:
            value, kind, message = check_value(reward(prompt, completion, row))
            outcome = (value, kind, message or "", "")
        except BaseException as e:  # noqa: BLE001 - everything a user reward does is reported
            outcome = (None, "raised", f"{type(e).__name__}: {e}"[:2000], traceback.format_exc()[-4000:])
        try:
            _write(out, outcome)
        except BrokenPipeError:
            return


if __name__ == "__main__":
    _child_main()
