"""The daemon's runtime directory: socket, pid file, ready file and log.

Layout of a runtime dir (created mode 0700, so the ipc socket inside is private to its user)::

    tpserve.sock   default ipc socket
    tpserve.pid    pid of the daemon; the daemon holds an exclusive flock on it while alive
    tpserve.ready  JSON {"pid", "address"[, "http"]}: written once the engine is loaded and the
                   socket bound (and the HTTP front listens, when there is one)
    tpserve.log    stdout/stderr of a daemon started with `tpserve start` (appended)

Liveness is decided by the flock, not by the pid alone: a pid file whose lock nobody holds is
stale (the daemon died without cleaning up), even if its pid was reused by another process.
"""
from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import time
from pathlib import Path

from tpserve.errors import TpserveError
# The daemon's process helpers live below the daemon so the workers can share them.
from tpserve.procs import descendants, kill_tree, pid_alive, wait_gone  # noqa: F401

SOCKET_NAME = "tpserve.sock"
PID_NAME = "tpserve.pid"
READY_NAME = "tpserve.ready"
LOG_NAME = "tpserve.log"
# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_IPC_PATH = 107


class RuntimeDirError(TpserveError, RuntimeError):
    """The runtime directory or address cannot be used (permissions, path length, a live daemon)."""


class InsecureAddressError(TpserveError, ValueError):
    """A non-loopback TCP address was requested without CurveZMQ keys."""


def default_runtime_dir() -> Path:
    """``$TPSERVE_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/tpserve``, else ``~/.tpserve``."""
    if os.environ.get("TPSERVE_RUNTIME_DIR"):
        return Path(os.environ["TPSERVE_RUNTIME_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "tpserve"
    return Path.home() / ".tpserve"


def resolve_runtime_dir(runtime_dir: str | os.PathLike | None) -> Path:
    return Path(runtime_dir).expanduser() if runtime_dir else default_runtime_dir()


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


def default_address(runtime_dir: str | os.PathLike | None = None) -> str:
    """``ipc://<runtime_dir>/tpserve.sock``."""
    sock = resolve_runtime_dir(runtime_dir) / SOCKET_NAME
    return f"ipc://{sock.absolute()}"


def resolve_address(address: str | None, runtime_dir: str | os.PathLike | None = None) -> str:
    """An explicit address, else ``$TPSERVE_ADDRESS``, else the runtime dir's ipc socket."""
    return address or os.environ.get("TPSERVE_ADDRESS") or default_address(runtime_dir)


def client_address(address: str | None, runtime_dir: str | os.PathLike | None = None) -> str:
    """Where a client finds the daemon: an explicit address, else ``$TPSERVE_ADDRESS``, else
    the address in the runtime dir's ready file (a daemon may serve on tcp://), else the
    runtime dir's default ipc socket."""
    explicit = address or os.environ.get("TPSERVE_ADDRESS")
    if explicit:
        return explicit
    ready = read_ready(resolve_runtime_dir(runtime_dir)) or {}
    bound = ready.get("address")
    return connect_address(bound) if isinstance(bound, str) and bound else default_address(runtime_dir)


# ---- address policy ----------------------------------------------------------------------
def _tcp_host(address: str) -> str:
    rest = address[len("tcp://"):]
    if rest.startswith("["):  # [::1]:5555
        return rest[1:rest.index("]")]
    host, _, port = rest.rpartition(":")
    if not host or not port:
        raise InsecureAddressError(f"address {address!r}: expected tcp://HOST:PORT")
    return host.split(";")[-1]  # tcp://source;dest form: the destination decides


def is_loopback_tcp(address: str) -> bool:
    host = _tcp_host(address)
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a DNS name: assume reachable from outside


def connect_address(bind_address: str) -> str:
    """An address a local client can connect to, for an address the daemon binds.

    Wildcard binds (``*``, ``0.0.0.0``, ``[::]``) are reached through loopback.
    """
    if not bind_address.startswith("tcp://"):
        return bind_address
    rest = bind_address[len("tcp://"):]
    host, _, port = rest.rpartition(":")
    if host in ("*", "0.0.0.0"):
        return f"tcp://127.0.0.1:{port}"
    if host in ("[::]", "[*]"):
        return f"tcp://[::1]:{port}"
    return bind_address


def check_address(address: str, has_curve_key: bool) -> None:
    """Refuse transports the daemon does not support and exposed TCP without CurveZMQ.

    ipc:// and inproc:// are private to the machine/process; tcp:// on a loopback address is
    reachable by local users only. Anything else must encrypt and authenticate with CURVE.
    """
    if address.startswith(("ipc://", "inproc://")):
        if address.startswith("ipc://") and len(address[len("ipc://"):].encode()) > MAX_IPC_PATH:
            raise RuntimeDirError(
                f"ipc socket path {address[6:]!r} is longer than {MAX_IPC_PATH} bytes; "
                "use a shorter --runtime-dir or an explicit --address")
        return
    if not address.startswith("tcp://"):
        raise InsecureAddressError(
            f"address {address!r}: supported transports are ipc://PATH and tcp://HOST:PORT")
    if not is_loopback_tcp(address) and not has_curve_key:
        raise InsecureAddressError(
            f"refusing to bind {address}: it is not a loopback address, so it needs CurveZMQ "
            "encryption; create keys with `tpserve keys DIR` and pass --curve-secret-key "
            "DIR/tpserve.key_secret (or bind tcp://127.0.0.1:PORT or the default ipc socket)")


# ---- pid file with a lock ----------------------------------------------------------------
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
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = read_pid(self.path.parent)
            raise RuntimeDirError(
                f"a tpserve daemon (pid {pid}) is already running with runtime dir "
                f"{self.path.parent}; stop it with `tpserve stop` or use another --runtime-dir") from None
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


def read_pid(runtime_dir: Path) -> int | None:
    try:
        return int((runtime_dir / PID_NAME).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def live_daemon_pid(runtime_dir: Path) -> int | None:
    """The pid of the daemon owning ``runtime_dir``, or None. Removes a stale pid file."""
    path = runtime_dir / PID_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
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


def read_ready(runtime_dir: Path) -> dict | None:
    try:
        return json.loads((runtime_dir / READY_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None
