"""Connections: which routing ids a closed connection carried, from the ROUTER's monitor events.

A ROUTER socket tells nothing when a peer goes away; only a send to it fails (EHOSTUNREACH).
A client whose requests are not streamed gets nothing sent until they finish, so without more
the daemon would compute every one of them for nobody. ZeroMQ's socket monitor reports each
accepted and each closed connection by its file descriptor, and every received message carries
the descriptor of the connection it came on (``zmq.SRCFD``); joining the two gives the routing
ids of a connection that closed.

Descriptors are reused by the kernel, so each accepted connection is a new ``Connection``
object: a routing id is tied to the object current for its descriptor when its message is
handled. ZeroMQ reports a connection's close before it frees the descriptor, and an accept
before any message of that connection can arrive, but both may reach the monitor after the
loop last drained it: so every message drains the pending events before it is tied (one
non-blocking read when there are none). A client that closes and the next one that gets its
descriptor, both between two drains, are then told apart; tying the new one's message to the
old connection made the old one's close drop the new client's requests. The monitor's queue is
unbounded: a lost accept would make a live connection look closed. (One race is left: a
message read from the socket before its connection closed, but handled after a new connection
got the same descriptor, is tied to the new one; its requests then end when their first reply
finds the peer gone.)

Messages of transports without descriptors (inproc) are not tracked (``fd`` -1).
"""
from __future__ import annotations

import itertools
import logging
import os

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("tpserve.daemon")

EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_MONITOR_SERIALS = itertools.count()


class Connection:
    """One accepted connection and the routing ids seen on it (one, for a DEALER)."""

    __slots__ = ("fd", "identities", "open")

    def __init__(self, fd: int):
        self.fd = fd
        self.identities: set[bytes] = set()
        self.open = True


class Connections:
    """Tracks connections of one ROUTER socket through its monitor socket (``monitor``).
    Made before the socket binds, so that no accept goes unseen."""

    def __init__(self, sock: zmq.Socket):
        # Unique in the process: a closed socket's monitor endpoint stays bound until ZeroMQ's
        # reaper gets to it, so a name made of id(self), which Python reuses at once, could clash.
        address = f"inproc://tpserve-monitor-{os.getpid()}-{next(_MONITOR_SERIALS)}"
        sock.monitor(address, EVENTS)
        self._sock = sock
        self.monitor = sock.context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)  # 0 on either side: the inproc pipe is unbounded
        self.monitor.connect(address)
        self._by_fd: dict[int, Connection] = {}
        self._gone: list[bytes] = []

    def drain_events(self) -> list[bytes]:
        """Process pending monitor events; returns the routing ids whose connection closed
        (also those found closed by ``attach`` since the previous call)."""
        self._read_events()
        gone, self._gone = self._gone, []
        return gone

    def _read_events(self) -> None:
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._by_fd[fd] = Connection(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                conn = self._by_fd.pop(fd, None)
                if conn is not None:
                    conn.open = False
                    self._gone.extend(conn.identities)

    def attach(self, identity: bytes, frame: zmq.Frame) -> bool:
        """Tie ``identity`` to the connection its message (``frame``, received with
        copy=False) came on; False if that connection is known to be closed already (the
        sender is gone: nothing it asked can be answered)."""
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:  # inproc: no descriptor
            return True
        if fd < 0:
            return True
        # The events queued before this message arrived first: the descriptor's connection may
        # have closed and a new one (this message's) taken the descriptor since the last drain.
        self._read_events()
        conn = self._by_fd.get(fd)
        if conn is None:  # its connection closed
            return False
        conn.identities.add(identity)
        return True

    def close(self) -> None:
        try:
            self._sock.disable_monitor()  # releases the inproc endpoint now
        except zmq.ZMQError:  # the ROUTER is closed already
            pass
        self.monitor.close(linger=0)
