"""Listener: the daemon's bound ROUTER socket, CurveZMQ, and the poller the serving loop sleeps in.

``Listener(address, ...)`` binds at once (a busy address fails before the slow model load).
The socket routes mandatorily: "peer gone" and "peer full" are errors (EHOSTUNREACH, EAGAIN)
instead of silent drops, so a stream is never missing a piece. An ``ipc://`` socket file is
private from its creation (umask 0177, then mode 0600) and removed by ``close``.

Connections are tracked through the socket's monitor (connections.py), so that the requests of
a client that went away can be aborted. The poller watches the socket, its monitor, a wake-up
socket pair (written by signal handlers through
``wake_fd`` and by other threads through ``wake``) and any extra descriptor the loop adds
(``watch``), so an idle loop sleeps in one ``poll`` and uses no CPU.
"""
from __future__ import annotations

import logging
import os
import socket

import zmq

from tpserve.client import protocol as P
from tpserve.server.connections import Connections

_CLOSE_LINGER_MS = 2000  # at close, at most this long for ZMQ to hand queued frames to the kernel


class Listener:
    """The bound socket (``sock``) and the loop's poller. ``close()`` when done."""

    def __init__(self, address: str, send_hwm: int, context: zmq.Context | None = None,
                 curve_public_key: bytes | None = None, curve_secret_key: bytes | None = None,
                 curve_client_keys_dir: str | None = None):
        self.address = address
        # An own context by default, so close() can wait (term) until final replies are out.
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._auth = None
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, send_hwm)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.connections = Connections(self.sock)
        if curve_secret_key is not None:
            self._enable_curve(curve_public_key, curve_secret_key, curve_client_keys_dir)
        # An ipc socket file is created by bind() in this thread; a umask keeps it private from
        # the start (not only after the chmod), and close() removes it.
        self._ipc_path = address[len("ipc://"):] if address.startswith("ipc://") else None
        old_umask = os.umask(0o177) if self._ipc_path else None
        try:
            self.sock.bind(address)
            if self._ipc_path:
                os.chmod(self._ipc_path, 0o600)
        except zmq.ZMQError as e:
            self.connections.close()
            self.sock.close(linger=0)
            self._stop_auth()
            if self._own_context:
                self._ctx.term()
            raise OSError(e.errno, f"cannot bind {address}: {e.strerror}") from None
        finally:
            if old_umask is not None:
                os.umask(old_umask)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.connections.monitor, zmq.POLLIN)
        self.poller.register(self._wake_r.fileno(), zmq.POLLIN)

    def _enable_curve(self, public_key, secret_key, client_keys_dir) -> None:
        if client_keys_dir is not None:
            from zmq.auth.thread import ThreadAuthenticator
            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("tpserve.daemon.auth"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(client_keys_dir))
        self.sock.curve_server = True
        self.sock.curve_secretkey = secret_key
        self.sock.curve_publickey = public_key

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    # ---- waking and sleeping -----------------------------------------------------------------
    def wake(self, *_) -> None:
        """Make a sleeping ``poll`` return (safe from signal handlers and other threads)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # buffer full: a wake-up is already pending

    @property
    def wake_fd(self) -> int:
        """Write end of the wake-up pair, for ``signal.set_wakeup_fd``."""
        return self._wake_w.fileno()

    def watch(self, fd) -> None:
        """Also wake ``poll`` when ``fd`` (a descriptor or a ZMQ socket) is readable."""
        self.poller.register(fd, zmq.POLLIN)

    def unwatch(self, fd) -> None:
        self.poller.unregister(fd)

    def poll(self, timeout_ms: int | None) -> dict:
        """Sleep until something is readable or ``timeout_ms`` passed (None: no limit); returns
        the readable sockets and descriptors. Pending wake-ups are consumed."""
        events = dict(self.poller.poll(timeout_ms))
        if self._wake_r.fileno() in events:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, InterruptedError):
                pass
        return events

    def close(self) -> None:
        """Close and remove the socket; returns once queued replies are delivered (at most 2 s)."""
        self.sock.disable_monitor()
        self.connections.close()
        self.sock.close(linger=_CLOSE_LINGER_MS)
        self._stop_auth()
        if self._ipc_path:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass
        self._wake_r.close()
        self._wake_w.close()
        if self._own_context:
            self._ctx.term()  # waits for the linger of the socket above
