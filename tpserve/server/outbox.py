"""Peers: the connections the front knows, each with its requests and its ordered send queue.

A connection is known by its ZMQ routing id while it has requests in flight or replies not yet
accepted by its socket; then it is forgotten. Sends never block the serving loop:

* a message is encoded when it is produced (a reply that does not encode is logged and
  dropped; an error reply that does not encode is sent without its details, because the answer
  to a frame must not be lost);
* a send the high-water mark refuses (EAGAIN) queues the frame in the peer's outbox, and every
  later message to that peer queues behind it, so one peer's messages leave in the order they
  were produced; ``flush`` retries the queues;
* a ``delta`` that has to queue is merged into the queued delta of the same request and
  completion (``id`` and ``index``), if one is still waiting behind the head of the queue (text,
  token ids and log-probabilities appended, up to ``MAX_MERGED_TOKENS`` / ``MAX_MERGED_CHARS``;
  a delta carrying ``prompt_logprobs`` is never merged into another; a completion's end, the
  ``finish_reason`` of its last delta, stays on the merged one): a reader that falls behind
  gets fewer, larger deltas, and its outbox holds about one message per completion and the
  request's ``done`` however far behind it is;
* a peer is never dropped for reading slowly. ZeroMQ tells a sender that its reader made
  progress only every half of the reader's receive high-water mark (1000 messages by default),
  so a client reading one message every few seconds accepts nothing for tens of minutes while
  it reads, and cannot be told from one that stopped. A peer is dropped when it is gone
  (EHOSTUNREACH, or its connection closed: connections.py) or when more than ``max_queued``
  messages wait for it although its deltas are merged (it keeps asking without reading):
  ``on_gone(peer, why)`` ends its requests, and nothing more is sent to it.
"""
from __future__ import annotations

import errno
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import zmq

from tpserve.client import protocol as P

log = logging.getLogger("tpserve.daemon")

# What one merged delta may carry; past either the next delta queues as a new message. Keeps a
# merged frame far below the 8 MiB a client is told to accept (docs/protocol.md).
MAX_MERGED_TOKENS = 4096
MAX_MERGED_CHARS = 1 << 20


class MergedDelta:
    """Deltas of one request, queued for its peer and sent as one ``delta``: the first's other
    fields, every delta's text, token ids and log-probabilities in order, and the completion's
    end (finish reason and counts) if the last one carries it."""

    __slots__ = ("first", "texts", "token_ids", "logprobs", "chars", "end")

    def __init__(self, msg: P.DeltaReply):
        self.first = msg
        self.texts = [msg.text]
        self.chars = len(msg.text)
        self.token_ids = list(msg.token_ids)
        self.logprobs = None if msg.logprobs is None else list(msg.logprobs)
        self.end: P.DeltaReply | None = None  # a merged delta that ended the completion

    def add(self, msg: P.DeltaReply) -> bool:
        """Append ``msg`` (a delta of the same request and completion), unless the merged delta
        would then exceed the limits or ``msg`` carries the prompt's log-probabilities."""
        if (msg.prompt_logprobs is not None
                or len(self.token_ids) + len(msg.token_ids) > MAX_MERGED_TOKENS
                or self.chars + len(msg.text) > MAX_MERGED_CHARS):
            return False
        self.texts.append(msg.text)
        self.chars += len(msg.text)
        self.token_ids += msg.token_ids
        if msg.logprobs:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(msg.logprobs)
        if msg.finish_reason is not None:
            self.end = msg
        return True

    def reply(self) -> P.DeltaReply:
        merged = replace(self.first, text="".join(self.texts), token_ids=self.token_ids,
                         logprobs=self.logprobs)
        if self.end is not None:
            end = self.end
            merged.finish_reason, merged.completion_tokens = end.finish_reason, end.completion_tokens
            merged.prompt_tokens, merged.cached_tokens = end.prompt_tokens, end.cached_tokens
        return merged


@dataclass
class Peer:
    """One connection. ``requests`` are its requests in flight, by the client's id. ``outbox``
    holds encoded frames and, behind its head, the ``MergedDelta``s still open to merging (also
    in ``open_deltas``, by request id, then completion index). Between calls the head of a
    non-empty outbox is a frame."""

    identity: bytes
    tag: int
    requests: dict = field(default_factory=dict)
    outbox: deque = field(default_factory=deque)
    open_deltas: dict = field(default_factory=dict)
    blocked_since: float = 0.0  # when the outbox last moved (or filled)


class Peers:
    """The known connections over one ROUTER socket. See the module docstring."""

    def __init__(self, sock: zmq.Socket, on_gone: Callable[[Peer, str], None], max_queued: int = 65536):
        self.sock = sock
        self.on_gone = on_gone
        self.max_queued = max_queued
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
        """Send ``msg`` now, or queue it behind what waits for ``peer`` (a delta merged into
        the queued one of its request, if any)."""
        if isinstance(msg, P.DeltaReply):
            if peer.outbox:
                self._queue_delta(peer, msg)
                return
        elif isinstance(msg, (P.DoneReply, P.ErrorReply)) and msg.id is not None:
            # Past its last message the id may start a new request, whose deltas must not join
            # this one's.
            peer.open_deltas.pop(msg.id, None)
        frame = self._encode(msg)
        if frame is None:
            return
        if peer.outbox:
            self._queue(peer, frame)
        else:
            self.try_send(peer, frame)

    def _queue_delta(self, peer: Peer, msg: P.DeltaReply) -> None:
        by_index = peer.open_deltas.setdefault(msg.id, {})
        merged = by_index.get(msg.index)
        if merged is not None and merged.add(msg):
            return
        merged = by_index[msg.index] = MergedDelta(msg)
        self._queue(peer, merged)

    def _queue(self, peer: Peer, entry) -> None:
        peer.outbox.append(entry)
        if len(peer.outbox) > self.max_queued:
            self.drop(peer, f"not reading: more than {self.max_queued} replies waiting")

    @staticmethod
    def _encode(msg: P.Message) -> bytes | None:
        try:
            return P.encode(msg)
        except P.ProtocolError as e:
            if not isinstance(msg, P.ErrorReply):
                log.exception("dropping a reply that does not encode: %r", msg)
                return None
            # The answer to a frame must not be lost (docs/protocol.md): keep its code and id,
            # drop the details that did not encode.
            log.error("an error reply did not encode (%s); sending it without details", e)
            return P.encode(P.ErrorReply(msg.code if msg.code in P.ERROR_CODES else P.INTERNAL,
                                         str(msg.message)[:P.MAX_MESSAGE_CHARS],
                                         id=P.readable_id({"id": msg.id})))

    def try_send(self, peer: Peer, frame: bytes) -> bool:
        """Send one frame now (``peer``'s outbox is empty); on refusal queue it (full) or drop
        the peer (gone)."""
        try:
            self.sock.send_multipart([peer.identity, frame], zmq.NOBLOCK)
            return True
        except zmq.Again:
            peer.blocked_since = time.monotonic()
            peer.outbox.append(frame)
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self.drop(peer, "disconnected")
        return False

    def flush(self, stall_timeout: float | None = None) -> None:
        """Retry every queue. With ``stall_timeout`` (only when the daemon exits: it cannot
        wait for slow readers), also give up on a peer whose queue has not moved for that many
        seconds."""
        now = time.monotonic()
        for peer in [p for p in self._peers.values() if p.outbox]:
            while peer.outbox:
                if not self._encode_head(peer):
                    continue
                try:
                    self.sock.send_multipart([peer.identity, peer.outbox[0]], zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as e:
                    if e.errno != errno.EHOSTUNREACH:
                        raise
                    self.drop(peer, "disconnected")
                    break
                peer.outbox.popleft()
                peer.blocked_since = now
            if peer.outbox and stall_timeout is not None and now - peer.blocked_since > stall_timeout:
                self.drop(peer, f"not reading for {stall_timeout:g} s at exit")
            else:
                self.forget_if_idle(peer)

    def _encode_head(self, peer: Peer) -> bool:
        """Make the head of ``peer``'s outbox a frame: a delta there is closed to merging (it
        is encoded once, however often its send is refused). False if it did not encode (it is
        then removed)."""
        head = peer.outbox[0]
        if not isinstance(head, MergedDelta):
            return True
        by_index = peer.open_deltas.get(head.first.id, {})
        if by_index.get(head.first.index) is head:
            del by_index[head.first.index]
        frame = self._encode(head.reply())
        if frame is None:
            peer.outbox.popleft()
            return False
        peer.outbox[0] = frame
        return True

    def drop(self, peer: Peer, why: str) -> None:
        """End every request of a peer that is gone or stalled; nothing more is sent to it."""
        if peer.requests:
            log.warning("client %s %s: aborting %d request(s)", peer.identity.hex(), why, len(peer.requests))
        self.on_gone(peer, why)
        peer.outbox.clear()
        peer.open_deltas.clear()
        if self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]
