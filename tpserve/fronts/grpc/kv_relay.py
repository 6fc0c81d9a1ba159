"""KvRelay: the daemon's KV-cache events, served again as smg's gRPC ``SubscribeKvEvents`` stream.

smg's event-driven cache-aware routing (its ``KvEventMonitor``, one subscription per gRPC
worker) reads ``smg.grpc.common.KvEventBatch`` messages from the worker's ``SubscribeKvEvents``
RPC (``common.proto`` of the ``smg-grpc-proto`` package). The gRPC front (grpc_front.py) reads
the daemon's own event stream (kv_events.py: ZMQ PUB plus its replay socket) with
:class:`KvEventsFeed`, and this relay turns each batch into one ``KvEventBatch``:

* sequence numbers: the daemon's batch ``s`` is the relay's ``s + 1``, so the first batch is 1
  and 0 stays "nothing yet", as a subscriber's ``start_sequence_number`` reads it;
* ``BlockStored`` → ``KvBlocksStored``: one ``KvBlock`` per block (its hash, its
  ``block_size`` token ids, the block size), the parent hash of the first block;
  ``BlockRemoved`` → ``KvBlocksRemoved``; ``AllBlocksCleared`` → ``KvCacheCleared``. Tier
  device, locality local;
* hashes: tpserve's chained xxh64 (blockpool/prefix_hash.py) is unsigned; the proto's fields
  are int64, so a hash at or above 2**63 is sent as its two's complement, and hash 0 (smg
  reserves it) as 1. smg keys blocks by these hashes and matches requests by its own hash of
  each block's token ids, so the chain only has to be consistent, which it is.

The relay keeps the cache's state as the events built it (hash → parent, tokens) and the last
``history`` batches. A subscriber that starts at 0 gets the state first: one batch numbered
with the current sequence, ``KvCacheCleared`` then a ``KvBlocksStored`` per cached block,
parents first. One that resumes at ``s`` gets the batches after ``s`` from the history, or,
when the history no longer reaches back, the state as a snapshot in ``current - s`` chunks
numbered ``s + 1 .. current`` (the first carries the events, the rest are empty), so the
numbers stay contiguous and live batches follow without a gap.

Nothing a subscriber does reaches the daemon: the feed reads the daemon's stream whatever the
subscribers do, and each subscriber has a bounded queue; one that falls ``queue_size`` batches
behind is dropped (``num_overflowed``), its stream ends with RESOURCE_EXHAUSTED, and on
reconnecting with its last sequence it is exact again.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque

import msgpack
import zmq
import zmq.asyncio
from smg_grpc_proto.generated import common_pb2 as C

from tpserve.server.kv_events import EVENT_FIELDS

log = logging.getLogger("tpserve.grpc")

_TWO_64 = 1 << 64
_TWO_63 = 1 << 63


def wire_hash(h: int) -> int:
    """tpserve's unsigned 64-bit block hash as the proto's int64 (0 is smg's reserved value)."""
    if h == 0:
        h = 1
    return h - _TWO_64 if h >= _TWO_63 else h


def decode_events(payload: bytes) -> tuple[float, list[tuple]]:
    """One PUB payload of kv_events.py (either format) as ``(ts, [(kind, fields...), ...])``:
    ``("stored", hashes, parent, token_ids, block_size)``, ``("removed", hashes)``,
    ``("cleared",)``."""
    ts, raw, _rank = msgpack.unpackb(payload, raw=False)
    events = []
    for e in raw:
        if isinstance(e, dict):
            kind = e.get("type")
            fields = e
        else:
            kind = e[0]
            fields = dict(zip(EVENT_FIELDS.get(kind, ()), e[1:]))
        if kind == "BlockStored":
            events.append(("stored", list(fields["block_hashes"]), fields["parent_block_hash"],
                           list(fields["token_ids"]), int(fields["block_size"])))
        elif kind == "BlockRemoved":
            events.append(("removed", list(fields["block_hashes"])))
        elif kind == "AllBlocksCleared":
            events.append(("cleared",))
        else:
            raise ValueError(f"unknown KV event type {kind!r}")
    return float(ts), events


def _stored(blocks: list, parent: int | None) -> C.KvCacheEvent:
    stored = C.KvBlocksStored(blocks=blocks, tier=C.KV_CACHE_TIER_DEVICE, locality=C.KV_CACHE_LOCALITY_LOCAL,
                              medium="GPU")
    if parent is not None:
        stored.parent_block_hash = wire_hash(parent)
    return C.KvCacheEvent(stored=stored)


class Subscriber:
    """One SubscribeKvEvents stream: the batches it starts with (an iterable), then its queue
    of live ones."""

    def __init__(self, initial, queue_size: int):
        self.initial = initial
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=queue_size)
        self.overflowed = False


class KvRelay:
    """State, history and subscribers; every method runs on the front's event loop."""

    def __init__(self, history: int = 10_000, queue_size: int = 4096):
        self.blocks: dict[int, tuple[int | None, tuple[int, ...], int]] = {}  # hash -> parent, tokens, size
        self.history: deque[tuple[int, C.KvEventBatch]] = deque(maxlen=history)
        self.seq = 0  # the last relayed batch's number (0: none)
        self.queue_size = queue_size
        self.subscribers: set[Subscriber] = set()
        self.num_batches = 0
        self.num_overflowed = 0

    # ---- the feed's side --------------------------------------------------------------------
    def apply(self, seq: int, ts: float, events: list[tuple]) -> None:
        """Take the daemon's batch (relay number ``seq``), update the state, send it out."""
        assert seq > self.seq, (seq, self.seq)
        out = []
        for e in events:
            if e[0] == "stored":
                _, hashes, parent, tokens, size = e
                blocks = []
                for i, h in enumerate(hashes):
                    chunk = tuple(tokens[i * size:(i + 1) * size])
                    self.blocks[h] = (parent if i == 0 else hashes[i - 1], chunk, size)
                    blocks.append(C.KvBlock(block_hash=wire_hash(h), token_ids=chunk, block_size=size))
                out.append(_stored(blocks, parent))
            elif e[0] == "removed":
                for h in e[1]:
                    self.blocks.pop(h, None)
                out.append(C.KvCacheEvent(removed=C.KvBlocksRemoved(
                    block_hashes=[wire_hash(h) for h in e[1]], tier=C.KV_CACHE_TIER_DEVICE,
                    locality=C.KV_CACHE_LOCALITY_LOCAL, medium="GPU")))
            else:
                self.blocks.clear()
                out.append(C.KvCacheEvent(cleared=C.KvCacheCleared()))
        for i, ev in enumerate(out):
            ev.event_id = (seq << 20) + i + 1
        batch = C.KvEventBatch(sequence_number=seq, timestamp=ts, events=out, dp_rank=0)
        self.seq = seq
        self.num_batches += 1
        self.history.append((seq, batch))
        for sub in list(self.subscribers):
            if sub.overflowed:
                continue
            try:
                sub.queue.put_nowait(batch)
            except asyncio.QueueFull:
                sub.overflowed = True
                self.num_overflowed += 1
                sub.queue.get_nowait()  # room for the marker that ends its stream
                sub.queue.put_nowait(None)

    # ---- the subscribers' side ----------------------------------------------------------------
    def subscribe(self, start: int) -> Subscriber:
        """A subscriber resuming after batch ``start`` (0: from the current state)."""
        if start == 0 or start > self.seq:
            initial = [self.snapshot(self.seq, 1)] if self.seq else []
        elif start == self.seq:
            initial = []
        elif self.history and self.history[0][0] <= start + 1 and self._contiguous():
            initial = [b for s, b in self.history if s > start]
        else:
            initial = self._chunks(start, self.seq)
        sub = Subscriber(initial, self.queue_size)
        self.subscribers.add(sub)
        return sub

    def _chunks(self, start: int, end: int):
        """The state now as a snapshot in chunks numbered ``start + 1 .. end``: the first carries
        it, the empty rest are made lazily (after a long absence there can be many)."""
        n = end - start
        first, blocks = self.snapshot(start + 1, n), len(self.blocks)

        def rest():
            for i in range(1, n):
                yield C.KvEventBatch(sequence_number=start + 1 + i, timestamp=time.time(), dp_rank=0,
                                     snapshot=C.KvSnapshotChunk(index=i, count=n, blocks=blocks))
        return itertools.chain([first], rest())

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    def _contiguous(self) -> bool:
        return self.history[-1][0] - self.history[0][0] + 1 == len(self.history)

    def snapshot(self, seq: int, count: int) -> C.KvEventBatch:
        """The state as the first chunk of a snapshot numbered ``seq``: cleared, then every
        cached block, parents before children."""
        depth: dict[int, int] = {}

        def depth_of(h: int) -> int:
            chain = []
            while h in self.blocks and h not in depth:
                chain.append(h)
                h = self.blocks[h][0]
                if len(chain) > len(self.blocks):  # a cycle cannot happen; stop if it did
                    break
            d = depth.get(h, -1) if h is not None else -1
            for x in reversed(chain):
                d += 1
                depth[x] = d
            return d

        for h in self.blocks:
            depth_of(h)
        events = [C.KvCacheEvent(cleared=C.KvCacheCleared())]
        for h in sorted(self.blocks, key=depth.__getitem__):
            parent, tokens, size = self.blocks[h]
            # A block whose parent left the cache still names it, as the live events did
            # (BlockManager.cached_blocks): its hash is chained from it.
            events.append(_stored([C.KvBlock(block_hash=wire_hash(h), token_ids=tokens, block_size=size)], parent))
        return C.KvEventBatch(sequence_number=seq, timestamp=time.time(), events=events, dp_rank=0,
                              snapshot=C.KvSnapshotChunk(index=0, count=count, blocks=len(self.blocks)))

    def stats(self) -> dict:
        return {"kv_relay_seq": self.seq, "kv_relay_blocks": len(self.blocks),
                "kv_relay_subscribers": len(self.subscribers), "kv_relay_overflowed": self.num_overflowed}


class KvEventsFeed:
    """Reads the daemon's event stream (PUB ``endpoint``, replay ROUTER ``replay_endpoint``)
    into a relay, in order and without gaps.

    It asks the replay socket for everything from batch 0 first, so the relay's state is the
    cache's from the start. A gap in the live stream (the PUB socket dropped messages) is filled
    from the replay socket. When the daemon's replay buffer no longer has the missing batches,
    the daemon publishes a resync (AllBlocksCleared, then every cached block); the feed waits
    for it, skips what it missed, and the relay's subscribers see the gap and resync from it."""

    REPLAY_TIMEOUT = 5.0

    def __init__(self, relay: KvRelay, endpoint: str, replay_endpoint: str, topic: str = "",
                 context: zmq.asyncio.Context | None = None):
        self.relay = relay
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode()
        self._ctx = context or zmq.asyncio.Context.instance()
        self.expected = 0       # the daemon's next batch number
        self._pending: dict[int, tuple[float, list]] = {}
        self._waiting_resync = False
        self.num_skipped = 0

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        replay = None
        try:
            replay = await self._ask_replay()
            while True:
                poller = zmq.asyncio.Poller()
                poller.register(sub, zmq.POLLIN)
                if replay is not None:
                    poller.register(replay, zmq.POLLIN)
                ready = dict(await poller.poll(self.REPLAY_TIMEOUT * 1000 if replay is not None else None))
                if replay is not None and replay in ready:
                    frames = await replay.recv_multipart()
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if seq < 0:
                        replay.close(linger=0)
                        replay = None
                        self._after_replay()
                    else:
                        self._take(seq, frames[2])
                elif replay is not None and not ready:  # the daemon did not answer: live only
                    replay.close(linger=0)
                    replay = None
                    self._after_replay()
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) != 3:
                        continue
                    seq = int.from_bytes(frames[1], "big")
                    self._take(seq, frames[2])
                    if replay is None and not self._waiting_resync and self._pending:
                        replay = await self._ask_replay()
        finally:
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    async def _ask_replay(self):
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        await sock.send_multipart([b"", self.expected.to_bytes(8, "big")])
        return sock

    def _take(self, seq: int, payload: bytes) -> None:
        if seq < self.expected:
            return
        try:
            ts, events = decode_events(payload)
        except (ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError) as e:
            log.warning("ignoring an unreadable KV events batch %d: %s", seq, e)
            events, ts = [], time.time()
        if self._waiting_resync:
            if events and events[0][0] == "cleared":
                self.num_skipped += seq - self.expected
                self._waiting_resync = False
                self._pending = {s: v for s, v in self._pending.items() if s > seq}
                self.expected = seq
            else:
                return
        if seq > self.expected:
            self._pending[seq] = (ts, events)
            return
        self._apply(seq, ts, events)
        while self.expected in self._pending:
            self._apply(self.expected, *self._pending.pop(self.expected))

    def _apply(self, seq: int, ts: float, events: list) -> None:
        self.relay.apply(seq + 1, ts, events)
        self.expected = seq + 1

    def _after_replay(self) -> None:
        """A replay ended; what it could not fill only a resync can."""
        if self._pending:
            log.warning("KV events %d.. are no longer in the daemon's replay buffer: waiting for its resync",
                        self.expected)
            self._waiting_resync = True
            for s in sorted(self._pending):  # a resync may already be among them
                ts, events = self._pending[s]
                if events and events[0][0] == "cleared":
                    del self._pending[s]
                    self._waiting_resync = False
                    self.num_skipped += s - self.expected
                    self.expected = s
                    self._pending = {k: v for k, v in self._pending.items() if k > s}
                    self._apply(s, ts, events)
                    while self.expected in self._pending:
                        self._apply(self.expected, *self._pending.pop(self.expected))
                    break
