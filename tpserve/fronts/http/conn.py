"""Connection limits of the HTTP front: uvicorn's h11 protocol with a cap and read deadlines.

What uvicorn (h11) does not bound by itself: a new connection gets no timer until it has sent a
whole request and had its response (``timeout_keep_alive`` runs only *between* requests, and is
cancelled by the first byte of the next one); a request head or body that arrives slowly is
waited for forever; ``limit_concurrency`` is checked only once a complete request head has
arrived. So connections that send nothing, or half a head, hold a descriptor each for ever;
once the front runs out, ``accept()`` fails (asyncio then logs a traceback per attempt) and
``/health`` waits in the listen backlog behind them.

``guarded_protocol(max_connections, request_timeout)`` makes the protocol class the front
serves with. Per connection:

* waiting for a request head (a fresh connection, or a keep-alive one after its response):
  the whole head must arrive within ``request_timeout`` seconds, else it is answered 408 and
  closed;
* receiving a body: it must be complete within ``request_timeout`` seconds of its head, else
  the connection is closed (the handler sees a disconnect) -- unless the front itself stopped
  reading at that moment (the handler had not consumed what had arrived yet): then the client
  gets another period.

An answer sent before the request's body was read (413 for a body over the cap, any early
error) must reach a client that is still sending that body: closing the socket while its data
keeps arriving resets the connection, and a client that writes its whole body before it reads
(Python's http.client, many others) then fails on a write and never sees the answer. So the
front closes such a connection gracefully: it half-closes it (the client reads the answer, then
the end of the stream) and reads and discards what still comes, until the client closes its
side, or sends nothing for ``request_timeout`` seconds, or LINGER_SECONDS pass; then it closes.
A lingering connection counts as idle for the cap below.

Across connections: at most ``max_connections`` are open. A connection that would exceed it
closes the one that has waited longest for a request head (idle connections are the cheapest
to lose: nothing of theirs is in progress); when every connection has a request in progress,
the newcomer is answered 503 and closed. Each event is logged through quiet_log's rate limit,
one line per kind.

``connection_limits()`` raises the descriptor limit to its hard maximum and derives the cap and
the accept backlog from it: the backlog bounds how many connections one readiness event of the
listening socket accepts before any of them is counted, so the cap leaves that many
descriptors (plus the front's own files and sockets) free.
"""
from __future__ import annotations

import json
import logging
import resource
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("tpserve.http")

_OWN_DESCRIPTORS = 128  # the front's own: ZMQ sockets and their pipes, tokenizer files, logs
#: Longest a connection answered before its body arrived keeps reading (and discarding) it.
LINGER_SECONDS = 30.0


def connection_limits() -> tuple[int, int]:
    """(max_connections, accept backlog) for this process, after raising RLIMIT_NOFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    backlog = max(16, min(1024, soft // 8))
    return max(16, soft - backlog - _OWN_DESCRIPTORS), backlog


def _error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


class _Transport:
    """A connection's transport as uvicorn's protocol and request cycles see it: ``close()`` of
    a connection whose client is still sending a request body already answered lingers
    (``GuardedH11Protocol._close``); everything else is the real transport's."""

    def __init__(self, transport, protocol: "GuardedH11Protocol"):
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol._close()

    def is_closing(self) -> bool:
        return self._transport.is_closing() or self._protocol._lingering is not None


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with the cap and the deadlines of the module doc (see ``guarded_protocol``)."""

    max_connections: int
    request_timeout: float
    #: connections waiting for a request head, oldest first (shared by the class's instances)
    waiting: dict

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # An answer goes out in several writes (head, body, chunks): without TCP_NODELAY a write
            # waits for the peer's ACK of the one before, which a keep-alive client delays up to
            # 40 ms. Every request on a reused connection paid it (/health: 44 ms, 3 ms with).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._raw_transport = transport
        self.transport = _Transport(transport, self)
        self._lingering = None  # the timer that ends a graceful close (LINGER_SECONDS)
        self._deadline = None
        self._phase = None
        if len(self.connections) > self.max_connections and not self._evict_one():
            log.warning("refused HTTP connections: all %d connections have a request in progress",
                        self.max_connections)
            self._reply_and_close(503, "the server has too many open connections; retry later",
                                  "too_many_connections")
            return
        self._track()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:  # the rest of a body already answered: discarded
            self._cancel_deadline()
            self._deadline = self.loop.call_later(self.request_timeout, self._raw_transport.close)
            return
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc) -> None:
        self.waiting.pop(self, None)
        self._cancel_deadline()
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)

    def _close(self) -> None:
        """Close the connection; gracefully (module doc) when its response is complete and the
        client is still sending the request's body."""
        transport = self._raw_transport
        if self._lingering is not None or transport.is_closing():
            transport.close()
            return
        answered = self.conn.our_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)
        if not (answered and self.conn.their_state is h11.SEND_BODY and transport.can_write_eof()):
            transport.close()
            return
        self._cancel_deadline()
        self._phase = None
        self._lingering = self.loop.call_later(LINGER_SECONDS, transport.close)
        self._deadline = self.loop.call_later(self.request_timeout, transport.close)
        self.waiting[self] = None  # nothing of it is in progress: the first to go when the cap is hit
        try:
            transport.write_eof()  # after the answer still buffered, if any
        except OSError:
            transport.close()
            return
        self.flow.resume_reading()

    # ---- phases --------------------------------------------------------------------------
    def _track(self) -> None:
        """Follow the client's h11 state: waiting for a head, sending a body, or done."""
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._phase:
            return
        self._phase = phase
        self._cancel_deadline()
        self.waiting.pop(self, None)
        if phase == "head":
            self.waiting[self] = None
        if phase is not None:
            self._deadline = self.loop.call_later(self.request_timeout, self._deadline_passed)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._phase == "head":
            log.warning("closed HTTP connections that sent no complete request head within %g s",
                        self.request_timeout)
            self._reply_and_close(408, f"no complete request head within {self.request_timeout:g} s",
                                  "request_timeout")
        elif self._phase == "body":
            if self.flow.read_paused:  # the handler has not read what came: not the client's delay
                self._deadline = self.loop.call_later(self.request_timeout, self._deadline_passed)
                return
            log.warning("closed HTTP connections whose request body was not complete within %g s",
                        self.request_timeout)
            self.transport.close()

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest for a request head; False if none."""
        for other in self.waiting:
            if other is not self:
                del self.waiting[other]
                log.warning("closed idle HTTP connections to stay within %d open connections",
                            self.max_connections)
                other.transport.close()
                return True
        return False

    def _reply_and_close(self, status: int, message: str, code: str) -> None:
        self.waiting.pop(self, None)
        self._cancel_deadline()
        self._phase = None
        if self.conn.our_state is h11.IDLE:
            body = _error_body(message, code)
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=status, headers=[
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")])))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:
                pass
        self.transport.close()


def guarded_protocol(max_connections: int, request_timeout: float) -> type:
    """The protocol class (uvicorn's ``http=``) of one front: its own cap, deadline and
    table of waiting connections."""
    if max_connections < 1 or not request_timeout > 0:
        raise ValueError(f"max_connections must be >= 1 and request_timeout > 0, got "
                         f"{max_connections}, {request_timeout}")
    return type("FrontH11Protocol", (GuardedH11Protocol,),
                {"max_connections": max_connections, "request_timeout": float(request_timeout), "waiting": {}})
