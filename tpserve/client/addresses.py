"""Where a tpserve daemon listens, as a client finds it: runtime dir, default socket, ready file,
and the address policy (ipc:// or loopback tcp://, anything else only with CurveZMQ).

A runtime dir (mode 0700, so the ipc socket inside is private to its user) holds ``tpserve.sock``
(the default ipc socket) and ``tpserve.ready`` (JSON ``{"pid", "address"[, "http"]}``, written by
the daemon once it serves); the server side of the directory is tpserve/server/runtime.py.
"""
from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path

from tpserve.errors import TpserveError

SOCKET_NAME = "tpserve.sock"
READY_NAME = "tpserve.ready"
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
def read_ready(runtime_dir: Path) -> dict | None:
    try:
        return json.loads((runtime_dir / READY_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None
