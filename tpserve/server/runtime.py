"""The daemon's runtime directory: socket, pid file, ready file and log.

Layout of a runtime dir (created mode 0700, so the ipc socket inside is private to its user)::

    tpserve.sock   default ipc socket
    tpserve.pid    pid of the daemon; the daemon holds an exclusive flock on it while alive
    tpserve.ready  JSON {"pid", "address"[, "http"]}: written once the engine is loaded and the
                   socket bound (and the HTTP front listens, when there is one)
    tpserve.log    stdout/stderr of a daemon started with `tpserve start` (appended)

Liveness is decided by the flock, not by the pid alone: a pid file whose lock nobody holds is
stale (the daemon died without cleaning up), even if its pid was reused by another process.
A daemon killed with SIGKILL leaves its pid, ready and socket files behind: ``live_daemon_pid``
(which every command that looks for the daemon calls: status, generate, stop, start, serve) and
``cleanup_stale`` remove them.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from tpserve.client.addresses import READY_NAME, SOCKET_NAME, RuntimeDirError, resolve_runtime_dir

PID_NAME = "tpserve.pid"
LOG_NAME = "tpserve.log"
# s a starting daemon retries a pid-file lock held for a moment (a `tpserve status` checking it).
_LOCK_PATIENCE = 0.5


def ensure_runtime_dir(runtime_dir: str | os.PathLike | None) -> Path:
    """Create the runtime dir (mode 0700) if needed and check nobody else can enter it."""
    path = resolve_runtime_dir(runtime_dir)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise RuntimeDirError(f"runtime dir {path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        # Existing dirs created by something else: tighten rather than serve on a shared socket.
        os.chmod(path, 0o700)
    return path


class PidFile:
    """The daemon's pid file, locked for the daemon's lifetime.

    ``acquire`` raises RuntimeDirError if another live daemon holds the lock; a stale file is
    overwritten. ``release`` removes the file. The lock dies with the process, so a crash never
    leaves a file that looks live.
    """

    def __init__(self, runtime_dir: Path):
        self.path = runtime_dir / PID_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        deadline = time.monotonic() + _LOCK_PATIENCE
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() < deadline:
                    # A command checking liveness holds the lock for a moment; a daemon, for good.
                    time.sleep(0.02)
                    continue
                pid = read_pid(self.path.parent)
                raise RuntimeDirError(
                    f"a tpserve daemon (pid {pid}) is already running with runtime dir "
                    f"{self.path.parent}; stop it with `tpserve stop` or use another --runtime-dir") from None
            if _same_file(fd, self.path):
                break
            # cleanup_stale removed the file between our open and our lock: lock the new one.
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def read_pid(runtime_dir: Path) -> int | None:
    try:
        return int((runtime_dir / PID_NAME).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def live_daemon_pid(runtime_dir: Path) -> int | None:
    """The pid of the daemon owning ``runtime_dir``, or None. Removes what a dead daemon left:
    its pid file (one whose lock nobody holds), ready file and socket."""
    path = runtime_dir / PID_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        # A daemon locks its pid file before it binds its socket or writes its ready file, and
        # removes it last: without one, a socket or ready file here is left over.
        cleanup_stale(runtime_dir)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        # Locked: the daemon is alive. It writes its pid right after locking; wait for it.
        for _ in range(100):
            pid = read_pid(runtime_dir)
            if pid is not None and pid > 0:
                return pid
            time.sleep(0.01)
        raise RuntimeDirError(f"{path} is locked by a live process but holds no pid")
    finally:
        os.close(fd)
    # Nobody holds the lock: stale. Only remove it if it is still unlocked (a daemon that is
    # starting right now locks before writing).
    cleanup_stale(runtime_dir)
    return None


def cleanup_stale(runtime_dir: Path) -> None:
    """Remove pid, ready and socket files left by a daemon that is gone."""
    pid_path = runtime_dir / PID_NAME
    try:
        fd = os.open(pid_path, os.O_RDONLY)
    except FileNotFoundError:
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # alive after all
        else:
            pid_path.unlink(missing_ok=True)
        finally:
            os.close(fd)
    (runtime_dir / READY_NAME).unlink(missing_ok=True)
    (runtime_dir / SOCKET_NAME).unlink(missing_ok=True)


def write_ready(runtime_dir: Path, address: str, http: str | None = None,
                shutdown_grace: float | None = None, grpc: str | None = None) -> None:
    """``http``, ``grpc``: the URLs of the HTTP and gRPC fronts, when they run; ``shutdown_grace``:
    how long its drain may take (`tpserve stop` waits that long before killing it)."""
    tmp = runtime_dir / (READY_NAME + ".tmp")
    ready = {"pid": os.getpid(), "address": address}
    if http:
        ready["http"] = http
    if grpc:
        ready["grpc"] = grpc
    if shutdown_grace is not None:
        ready["shutdown_grace"] = shutdown_grace
    tmp.write_text(json.dumps(ready))
    os.replace(tmp, runtime_dir / READY_NAME)  # atomic: readers never see half a file
