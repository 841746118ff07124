"""A sandbox subprocess for code that a reward (or, later, a tool) executes.

`run_code(code, stdin="", timeout_s=5, memory_mb=512)` writes the code into a temporary folder of
its own and runs `python -I main.py` there through a small launcher that, before exec:

- leaves the network: a new network namespace (`unshare(CLONE_NEWNET)`, as root; unprivileged,
  with a user namespace too), so only a loopback that is down exists: every connect fails with
  "Network is unreachable". Where no namespace can be made the code is NOT run: the result has
  status "unavailable" (there is no weaker fallback that still claims "no network");
- sets rlimits: RLIMIT_AS (memory_mb), RLIMIT_CPU (cpu_s, default timeout_s), RLIMIT_FSIZE
  (file_mb), RLIMIT_NPROC (max_procs), RLIMIT_NOFILE (64), no core files;
- as root, mounts an empty private tmpfs on /tmp, /var/tmp and /dev/shm (a mount namespace), and
  drops to uid/gid 65534 (nobody) with no groups, so RLIMIT_NPROC is enforced (root
  ignores it) and the code cannot write outside its folder. The code runs in this interpreter,
  or, when nobody cannot reach it (a pyenv under /root), in the system python3 (`sandbox_python`).

The parent waits at most timeout_s of wall time, then kills the whole process group (a fork
bomb's children too) and removes the folder. `SandboxResult.status` says what happened: "ok",
"error" (non-zero exit), "timeout", "cpu_limit", "memory_limit", "process_limit",
"file_size_limit", "network_blocked" or "unavailable"; `detail` says why in one line.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

NOBODY = 65534
_UNAVAILABLE = 97

# Runs in the child, before the user's code: isolation, limits, then exec of a fresh interpreter.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
with open("main.py") as f:  # read before /tmp is replaced (the folder lives there)
    program = f.read()
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
root = os.geteuid() == 0
if libc.unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET) != 0:
    sys.stderr.write("sandbox unavailable: unshare(CLONE_NEWNET) failed: " + os.strerror(ctypes.get_errno()) + "\n")
    os._exit(97)
if root:  # a private, empty /tmp, /var/tmp and /dev/shm: nothing written there outlives the run
    CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x00020000, 0x4000, 0x40000
    if libc.unshare(CLONE_NEWNS) == 0 and libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0:
        for d in (b"/tmp", b"/var/tmp", b"/dev/shm"):
            if os.path.isdir(d):
                libc.mount(b"tmpfs", d, b"tmpfs", 0, b"size=16m,mode=1777")
mb = 1024 * 1024
for name, value in (("RLIMIT_AS", cfg["memory_mb"] * mb), ("RLIMIT_FSIZE", cfg["file_mb"] * mb),
                    ("RLIMIT_NPROC", cfg["max_procs"]), ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), (value, value))
cpu = int(cfg["cpu_s"] + 0.999)
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
if root:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
os.execv(cfg["python"], [cfg["python"], "-I", "-c", program])
"""


def _others_can_run(path: str) -> bool:
    """Can uid nobody execute `path` (others' x bits on the file and every folder above)?"""
    path = os.path.realpath(path)
    if not os.path.isfile(path) or not os.stat(path).st_mode & 0o001:
        return False
    folder = os.path.dirname(path)
    while True:
        if not os.stat(folder).st_mode & 0o001:
            return False
        if folder == os.path.dirname(folder):
            return True
        folder = os.path.dirname(folder)


def sandbox_python() -> str | None:
    """The interpreter the sandboxed code runs in: this one unless we are root and uid nobody
    cannot reach it (e.g. a pyenv under /root), then the system's python3 (standard library
    only). None when there is none."""
    if os.geteuid() != 0 or _others_can_run(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if _others_can_run(candidate):
            return candidate
    return None


@dataclass(frozen=True)
class SandboxResult:
    status: str
    returncode: int
    stdout: str
    stderr: str
    detail: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _classify(code: int, stderr: str, timed_out: bool, cfg: dict) -> tuple[str, str]:
    last = next((line for line in reversed(stderr.strip().splitlines()) if line.strip()), "")
    if timed_out:
        return "timeout", f"killed after timeout_s={cfg['timeout_s']:g} s of wall time"
    if code == _UNAVAILABLE and "sandbox unavailable" in stderr:
        return "unavailable", last
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit", f"killed by {signal.Signals(-code).name} at the CPU limit of {cfg['cpu_s']:g} s"
    if code == -signal.SIGXFSZ or "File too large" in stderr:
        return "file_size_limit", f"wrote past file_mb={cfg['file_mb']} MB"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory_limit", f"refused memory beyond memory_mb={cfg['memory_mb']} MB ({last[:120]})"
    if "BlockingIOError" in stderr or "Resource temporarily unavailable" in stderr:
        return "process_limit", f"refused a process beyond max_procs={cfg['max_procs']} ({last[:120]})"
    if "Network is unreachable" in stderr or "[Errno 101]" in stderr:
        return "network_blocked", f"no network in the sandbox ({last[:120]})"
    if code == 0:
        return "ok", ""
    return "error", f"exit code {code}: {last[:200]}"


def run_code(code: str, *, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512,
             cpu_s: float | None = None, file_mb: int = 16, max_procs: int = 16,
             max_output_bytes: int = 1 << 20) -> SandboxResult:
    """Run Python `code` in the sandbox (module docstring); never raises for what the code does."""
    python = sandbox_python()
    if python is None:
        return SandboxResult("unavailable", _UNAVAILABLE, "", "", "no python interpreter that uid nobody can run")
    cfg = dict(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s or timeout_s, file_mb=file_mb,
               max_procs=max_procs, uid=NOBODY, python=python)
    folder = tempfile.mkdtemp(prefix="laminar-sandbox-")
    try:
        with open(os.path.join(folder, "main.py"), "w") as f:
            f.write(code)
        if os.geteuid() == 0:
            os.chown(folder, NOBODY, NOBODY)
            os.chmod(folder, 0o700)
        env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}
        proc = subprocess.Popen([sys.executable, "-I", "-c", _LAUNCHER, json.dumps(cfg)], cwd=folder, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:  # the whole group: children of a fork bomb outlive their parent
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if timed_out:
            out, err = proc.communicate()
        code_ = proc.returncode
        out_s = out[:max_output_bytes].decode("utf-8", "replace")
        err_s = err[-max_output_bytes:].decode("utf-8", "replace")
        status, detail = _classify(code_, err_s, timed_out, cfg)
        return SandboxResult(status, code_, out_s, err_s, detail)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
