"""Peers: the connections the front knows, each with its requests and its ordered send queue.

A connection is known by its ZMQ routing id while it has requests in flight or replies not yet
accepted by its socket; then it is forgotten. Sends never block the serving loop:

* a message is encoded when it is produced (a reply that does not encode is logged and
  dropped; an error reply that does not encode is sent without its details, because the answer
  to a frame must not be lost);
* a send the high-water mark refuses (EAGAIN) queues the frame in the peer's outbox, and every
  later message to that peer queues behind it, so one peer's messages leave in the order they
  were produced; ``flush`` retries the queues;
* a peer whose queue has not moved for the stall timeout, or that is gone (EHOSTUNREACH), is
  dropped: ``on_gone(peer, why)`` ends its requests, and nothing more is sent to it.
"""
from __future__ import annotations

import errno
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import zmq

from tpserve.daemon import protocol as P

log = logging.getLogger("tpserve.daemon")


@dataclass
class Peer:
    """One connection. ``requests`` are its requests in flight, by the client's id."""

    identity: bytes
    tag: int
    requests: dict = field(default_factory=dict)
    outbox: deque = field(default_factory=deque)
    blocked_since: float = 0.0


class Peers:
    """The known connections over one ROUTER socket. See the module docstring."""

    def __init__(self, sock: zmq.Socket, on_gone: Callable[[Peer, str], None]):
        self.sock = sock
        self.on_gone = on_gone
        self._peers: dict[bytes, Peer] = {}
        self._next_tag = 0

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, identity: bytes) -> Peer | None:
        return self._peers.get(identity)

    def peer(self, identity: bytes) -> Peer:
        """The peer of ``identity``, made known if it was not; its tag is unique for the run."""
        peer = self._peers.get(identity)
        if peer is None:
            self._next_tag += 1
            peer = self._peers[identity] = Peer(identity, self._next_tag)
        return peer

    def forget_if_idle(self, peer: Peer) -> None:
        if not peer.requests and not peer.outbox and self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]

    def any_queued(self) -> bool:
        """Whether some peer has frames waiting for its socket to accept them."""
        return any(p.outbox for p in self._peers.values())

    # ---- sending -----------------------------------------------------------------------------
    def reply(self, identity: bytes, msg: P.Message) -> None:
        """Answer a request outside any generation (errors, status, pong)."""
        peer = self.peer(identity)
        self.send(peer, msg)
        self.forget_if_idle(peer)

    def send(self, peer: Peer, msg: P.Message) -> None:
        try:
            frame = P.encode(msg)
        except P.ProtocolError as e:
            if not isinstance(msg, P.ErrorReply):
                log.exception("dropping a reply that does not encode: %r", msg)
                return
            # The answer to a frame must not be lost (docs/protocol.md): keep its code and id,
            # drop the details that did not encode.
            log.error("an error reply did not encode (%s); sending it without details", e)
            frame = P.encode(P.ErrorReply(msg.code if msg.code in P.ERROR_CODES else P.INTERNAL,
                                          str(msg.message)[:P.MAX_MESSAGE_CHARS],
                                          id=P.readable_id({"id": msg.id})))
        if peer.outbox:
            peer.outbox.append(frame)
            return
        self.try_send(peer, frame)

    def try_send(self, peer: Peer, frame: bytes) -> bool:
        """Send one frame now; on refusal queue it (full) or drop the peer (gone)."""
        try:
            self.sock.send_multipart([peer.identity, frame], zmq.NOBLOCK)
            return True
        except zmq.Again:
            if not peer.outbox:
                peer.blocked_since = time.monotonic()
            peer.outbox.append(frame)
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self.drop(peer, "disconnected")
        return False

    def flush(self, stall_timeout: float) -> None:
        """Retry every queue; drop a peer whose queue has not moved for ``stall_timeout`` s."""
        now = time.monotonic()
        for peer in [p for p in self._peers.values() if p.outbox]:
            while peer.outbox:
                frame = peer.outbox[0]
                try:
                    self.sock.send_multipart([peer.identity, frame], zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as e:
                    if e.errno != errno.EHOSTUNREACH:
                        raise
                    self.drop(peer, "disconnected")
                    break
                peer.outbox.popleft()
                peer.blocked_since = now
            if peer.outbox and now - peer.blocked_since > stall_timeout:
                self.drop(peer, f"not reading for {stall_timeout:g} s")
            else:
                self.forget_if_idle(peer)

    def drop(self, peer: Peer, why: str) -> None:
        """End every request of a peer that is gone or stalled; nothing more is sent to it."""
        if peer.requests:
            log.warning("client %s %s: aborting %d request(s)", peer.identity.hex(), why, len(peer.requests))
        self.on_gone(peer, why)
        peer.outbox.clear()
        if self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]
