"""Version buffers in anonymous shared memory, mapped read-only by rollouts and same-host relays.

A relay's version buffer is a memfd (Linux `memfd_create`): anonymous memory that belongs to
the relay process and has no name in any file system, so a relay that dies leaves nothing behind
and no /dev/shm size limit applies. Another process on the same host maps it through
`/proc/<pid>/fd/<fd>`:

    rollouts          map the served version read-only instead of reading a copy in the object
                      store: serving a version costs no copy at all (Laminar §4.2: rollouts pull
                      from their node's relay through shared memory);
    same-host relays  share the upstream relay's buffer (`SharedBuffer.adopt`: an fd of their
                      own, so the version outlives the upstream) and check each chunk in it as
                      the upstream announces it: no copy at all, and one copy of a version per
                      host whatever the number of relays there (as NCCL uses shared memory for
                      peers on one node). Relays on other hosts get the bytes over TCP.

A `BufferHandle` (pid, fd, inode, size, host key) names a buffer. Once the relay supersedes a
version it closes that fd: mappings made before stay valid (the kernel frees the memory with the
last mapping), later opens fail with `BufferGone`. fds are reused by the kernel, so the inode is
checked after opening: a handle never maps another version's bytes. `host_key` (boot id and pid
namespace) tells whether /proc/<pid> names the same process for a peer.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import queue
import threading

import numpy as np

__all__ = ["BufferHandle", "BufferGone", "NotLocal", "SharedBuffer", "BufferPool", "available",
           "host_key", "open_handle", "drop_later", "background_priority"]

# `take` waits this long for a buffer being prepared in the background (a loaded host faults
# pages in slowly), then allocates its own
PREPARE_TIMEOUT_S = 30.0


class BufferGone(LookupError):
    """The buffer was released (a newer version replaced it): ask for the latest again."""


class NotLocal(LookupError):
    """The buffer lives on another host or pid namespace: it cannot be mapped from here."""


def available() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def host_key() -> str:
    """Equal for two processes exactly when /proc/<pid> names the same process for both."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"no-proc:{os.getpid()}"   # unique: never matches another process


@dataclasses.dataclass(frozen=True)
class BufferHandle:
    pid: int
    fd: int
    inode: int
    nbytes: int
    host: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "BufferHandle":
        return cls(int(d["pid"]), int(d["fd"]), int(d["inode"]), int(d["nbytes"]), str(d["host"]))


class SharedBuffer:
    """A writable uint8 buffer of `nbytes` in a memfd owned by this process."""

    def __init__(self, nbytes: int, *, name: str = "laminar-weights", populate: bool = True):
        self._fd: int | None = None
        if nbytes <= 0:
            raise ValueError(f"SharedBuffer: nbytes must be positive, got {nbytes}")
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            if populate:
                os.posix_fallocate(fd, 0, nbytes)   # ENOSPC/ENOMEM here, not as a SIGBUS later
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.writable = True
        self.array = np.frombuffer(self._map, np.uint8)
        if populate:
            # Fault every page in now (off the receive path when prepared ahead). Not with
            # MAP_POPULATE: mmap() holds the GIL for the whole fault-in (~0.9 s per GB here),
            # which would stall the relay's stream threads; numpy's fill releases it.
            self.array[::mmap.PAGESIZE] = 0
        self.handle = BufferHandle(os.getpid(), fd, os.fstat(fd).st_ino, nbytes, host_key())

    @classmethod
    def adopt(cls, handle: BufferHandle, array: np.ndarray) -> "SharedBuffer":
        """Shares another process's buffer, already mapped here as `array` (read-only): this
        process keeps an fd of its own, so it can hand out a handle (`self.handle`) and the
        memory lives on while any holder does, whatever becomes of the owner."""
        if handle.host != host_key():
            raise NotLocal(f"buffer of pid {handle.pid} is on host {handle.host}, not this one")
        fd = _open_checked(handle)
        self = cls.__new__(cls)
        self._fd, self._map, self.writable, self.array = fd, None, False, array
        self.handle = BufferHandle(os.getpid(), fd, handle.inode, handle.nbytes, host_key())
        return self

    @property
    def nbytes(self) -> int:
        return self.handle.nbytes

    def release(self) -> None:
        """No new mappings from now on; existing ones (ours included) stay valid."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self):
        self.release()


def _open_checked(handle: BufferHandle) -> int:
    """A read-only fd of the buffer `handle` names (the inode is checked: fds get reused)."""
    try:
        fd = os.open(f"/proc/{handle.pid}/fd/{handle.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BufferGone(f"buffer fd {handle.fd} of pid {handle.pid} was released") from None
    except PermissionError as e:
        raise NotLocal(f"cannot open the buffer of pid {handle.pid}: {e}") from None
    st = os.fstat(fd)
    if st.st_ino != handle.inode or st.st_size != handle.nbytes:
        os.close(fd)
        raise BufferGone(f"fd {handle.fd} of pid {handle.pid} now holds another buffer")
    return fd


def open_handle(handle: BufferHandle) -> np.ndarray:
    """A read-only uint8 view of the buffer `handle` names (no copy)."""
    if handle.host != host_key():
        raise NotLocal(f"buffer of pid {handle.pid} is on host {handle.host}, not this one")
    fd = _open_checked(handle)
    try:
        return np.frombuffer(mmap.mmap(fd, handle.nbytes, access=mmap.ACCESS_READ), np.uint8)
    finally:
        os.close(fd)


class BufferPool:
    """Hands out SharedBuffers; `prepare(nbytes)` allocates and faults in the next one on a
    background thread, so a version arriving later is received into pages already mapped."""

    def __init__(self, name: str = "laminar-weights"):
        self._name = name
        self._lock = threading.Lock()
        self._ready: SharedBuffer | None = None
        self._thread: threading.Thread | None = None

    def prepare(self, nbytes: int) -> None:
        with self._lock:
            if self._thread is not None or (self._ready is not None
                                            and self._ready.nbytes == nbytes):
                return
            self._thread = threading.Thread(target=self._fill, args=(nbytes,), daemon=True,
                                            name="buffer-prepare")
            self._thread.start()

    def _fill(self, nbytes: int) -> None:
        background_priority()
        try:
            buf = SharedBuffer(nbytes, name=self._name)
        except OSError:
            buf = None    # out of memory now: `take` allocates on demand and reports the error
        with self._lock:
            self._ready, self._thread = buf, None

    def take(self, nbytes: int, *, populate: bool = True) -> SharedBuffer:
        """The prepared buffer if it has `nbytes`, else a new one (faulted in unless `populate`
        is False: for a writer that touches every page soon anyway)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(PREPARE_TIMEOUT_S)   # still faulting pages after that: a new buffer
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is not None and ready.nbytes == nbytes:
            return ready
        return SharedBuffer(nbytes, name=self._name, populate=populate)


_doomed: "queue.SimpleQueue[object]" = queue.SimpleQueue()
_reaper_lock = threading.Lock()
_reaper: threading.Thread | None = None


def drop_later(obj: object) -> None:
    """Drops this reference to `obj` on a background thread. Unmapping the last mapping of a
    version frees its pages, ~0.2 s per GB here: not on a thread that moves the next version."""
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="buffer-reaper", daemon=True)
            _reaper.start()
    _doomed.put(obj)


def background_priority() -> None:
    """Lowest CPU priority for the calling thread (Linux: a thread's own nice value): page
    freeing and pre-faulting must not take cores from the threads moving a version."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _reap() -> None:
    background_priority()
    while True:
        obj = _doomed.get()
        del obj      # munmap releases the GIL
