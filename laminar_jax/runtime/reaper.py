"""Fate-sharing for the embedded Ray: a `laminar train` killed by SIGKILL leaves no process behind.

Ray's GCS and raylet die with the driver (PR_SET_PDEATHSIG), and the raylet takes its workers
with it, but its agents (dashboard agent, runtime-env agent) only notice after several parent
checks and then try to report to the dead GCS, so they outlive the run by a minute or more (seen
in tests/laminar_jax/runtime/test_resume_driver_kill.py). `start()` forks a small watcher
process before Ray starts. It holds the read end of a pipe whose write end only the driver
holds, and every POLL_S it records the driver's descendants (pid and start time). When the
pipe reads EOF (the driver exited, however it died), it SIGKILLs every recorded process that
is still the same process, then exits. A normal exit has already stopped Ray; then there is
nothing left to kill.

Run as a script (`python reaper.py PID FD`): it imports psutil only, not the package.
"""
from __future__ import annotations

import os
import select
import subprocess
import sys

POLL_S = 0.5
_pipes: list[int] = []   # the write end, open for the driver's whole life


def start() -> subprocess.Popen | None:
    """Starts the watcher of this process (None: one already watches it)."""
    if _pipes:
        return None
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid()), str(read_fd)],
                            pass_fds=(read_fd,), start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(read_fd)
    os.set_inheritable(write_fd, False)   # Ray's processes must not keep the pipe open
    _pipes.append(write_fd)
    return proc


def watch(pid: int, fd: int) -> list[int]:
    """Records `pid`'s descendants until `fd` reads EOF, then kills those still alive."""
    import psutil
    me = os.getpid()
    seen: dict[int, float] = {}
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    while True:
        try:
            for p in root.children(recursive=True):
                if p.pid != me:
                    seen.setdefault(p.pid, p.create_time())
        except psutil.NoSuchProcess:
            pass
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready and os.read(fd, 1) == b"":
            break
    killed = []
    for child, created in seen.items():
        try:
            p = psutil.Process(child)
            if p.create_time() == created:   # the same process, not a reused pid
                p.kill()
                killed.append(child)
        except psutil.NoSuchProcess:
            continue
    return killed


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
