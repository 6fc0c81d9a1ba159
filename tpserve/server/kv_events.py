"""KVEventPublisher: the prefix cache's events on a ZMQ PUB socket, in vLLM's wire format.

A router with a KV index (vllm-router's KV-aware policies, llm-d's precise prefix-cache scorer,
Dynamo's ZMQ relay) subscribes and learns which blocks each replica holds, evictions included.
The format is vLLM's (``vllm/distributed/kv_events.py``, msgspec structs with
``array_like=True`` and tagged events), so every consumer of vLLM's events reads tpserve's:

* PUB message: three frames ``[topic, sequence number (8 bytes, big-endian), payload]``; the
  sequence number counts batches from 0 and never skips, except for batches dropped here
  (below), so a gap tells a subscriber it missed something;
* payload: msgpack ``[ts, [event, ...], data_parallel_rank]`` with ``ts`` in seconds since the
  epoch and rank 0; each event a map tagged by ``"type"``, as current vLLM sends them
  (docs/scaling.md has the field table): ``{"type": "BlockStored", "block_hashes",
  "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}``,
  ``{"type": "BlockRemoved", "block_hashes", "medium"}``, ``{"type": "AllBlocksCleared"}``;
  each BlockStored and BlockRemoved map also carries the KV-cache group: ``group_idx``,
  ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window`` (blockpool/kv_events.py);
  ``lora_id`` and ``lora_name`` are nil, ``medium`` is ``"GPU"`` (the device KV pool, also on
  CPU), ``"CPU"`` (the host-RAM KV tier) or ``"STORAGE"`` (the disk tier). ``format="array"`` sends
  each event as the positional array earlier vLLM releases
  sent (``["BlockStored", block_hashes, ...]``, fields in the order above) for consumers of
  that layout;
* replay (optional ROUTER socket, as vLLM's): a client sends ``start_seq`` (8 bytes,
  big-endian) after an empty delimiter frame and gets every buffered batch from it as
  ``["", seq, payload]`` messages, then ``["", -1, ""]``. Use a DEALER: a REQ socket keeps
  only the first message of the answer.

Block hashes are tpserve's chained xxh64 (tpserve.blockpool.prefix_hash), unsigned 64-bit.

Nothing here can slow the engine: the serving loop hands each step's events to ``publish``,
which only numbers them and puts them on a bounded queue; a thread encodes and sends. PUB
never blocks (a subscriber past its high-water mark loses messages, and finds the gap by the
sequence numbers). When the queue is full the batch is dropped and counted (``num_dropped``),
and the next batch is a resync: ``AllBlocksCleared`` then every cached block (``resync_wanted``
tells the loop to ask the engine for one). A replay request older than the replay buffer also
gets a resync batch published, so a subscriber that fell far behind is exact again without
reconnecting.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgpack
import zmq

from tpserve.blockpool.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tpserve.client.addresses import InsecureAddressError, is_loopback_tcp

log = logging.getLogger("tpserve.kv_events")

MEDIUM = "GPU"  # vLLM's name of the device KV pool
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


FORMATS = ("map", "array")
#: Each event's fields after its tag, in the order of the "array" format.
EVENT_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
#: The KV-cache group fields the "map" format adds to BlockStored and BlockRemoved (vLLM's
#: hybrid KV cache names the group and its attention spec); the "array" layout stays as it was.
GROUP_FIELDS = ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")


def encode_event(event, format: str = "map") -> dict | list:
    """One event as vLLM's tagged struct: a map with ``"type"`` first, or (``"array"``) the
    positional array of earlier vLLM releases."""
    assert isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)), event
    values = {"medium": MEDIUM, **event._asdict(), "lora_id": None, "lora_name": None}
    tag = type(event).__name__
    fields = {name: values[name] for name in EVENT_FIELDS[tag]}
    if format == "map" and tag != "AllBlocksCleared":
        fields.update((name, values[name]) for name in GROUP_FIELDS)
    return [tag, *fields.values()] if format == "array" else {"type": tag, **fields}


def encode_batch(events, ts: float, data_parallel_rank: int = 0, format: str = "map") -> bytes:
    """The msgpack payload of one batch (vLLM's ``KVEventBatch``, a positional array)."""
    return msgpack.packb([ts, [encode_event(e, format) for e in events], data_parallel_rank],
                         use_bin_type=True)


def check_kv_events_endpoint(endpoint: str, allow_remote: bool) -> None:
    """Refuse endpoints the publisher cannot bind, and non-loopback ones unless allowed:
    the events carry prompt token ids, and PUB has no authentication."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"KV events endpoint {endpoint!r}: must be tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if endpoint.startswith("tcp://") and not is_loopback_tcp(endpoint) and not allow_remote:
        raise InsecureAddressError(
            f"refusing to publish KV events on {endpoint}: it is not a loopback address and the events "
            "carry prompt token ids; bind 127.0.0.1, or pass --kv-events-allow-remote")


@dataclass
class KVEventsOptions:
    """Where to publish (``--kv-events-endpoint`` and friends); checked at construction."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    allow_remote: bool = False
    format: str = "map"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"KV events format {self.format!r}: must be one of {', '.join(FORMATS)}")
        for ep in (self.endpoint, self.replay_endpoint):
            if ep is not None:
                check_kv_events_endpoint(ep, self.allow_remote)

    def publisher(self) -> "KVEventPublisher":
        return KVEventPublisher(self.endpoint, self.replay_endpoint, self.topic, format=self.format)


class KVEventPublisher:
    """Binds ``endpoint`` (and ``replay_endpoint``) at construction; ``publish`` from the serving
    loop; ``close`` when done. Counters: ``num_published``, ``num_dropped``."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, max_queue: int = 4096, hwm: int = 100_000,
                 context: zmq.Context | None = None, format: str = "map"):
        self.endpoint = endpoint
        self.format = format
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._ctx = context or zmq.Context.instance()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # for replays
        self._next_seq = 0
        self.num_published = 0
        self.num_dropped = 0
        self._resync = threading.Event()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        self._bound: list[str] = []
        try:
            self._pub.bind(endpoint)
            self._bound.append(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self._bound.append(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(e.errno, f"cannot bind the KV events socket: {e.strerror}") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpserve-kv-events", daemon=True)
        self._thread.start()
        log.info("publishing KV-cache events on %s%s", endpoint,
                 f" (replay on {replay_endpoint})" if replay_endpoint else "")

    # ---- the serving loop's side ----------------------------------------------------------
    def resync_wanted(self) -> bool:
        """True (once) when the next batch should be a full resync of the cache."""
        if self._resync.is_set():
            self._resync.clear()
            return True
        return False

    def publish(self, events: list) -> None:
        """Number ``events`` as the next batch and queue them; never blocks. No events: nothing."""
        if not events:
            return
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            self._resync.set()

    def stats(self) -> dict:
        return {"kv_events_published": self.num_published, "kv_events_dropped": self.num_dropped,
                "kv_events_next_seq": self._next_seq}

    # ---- the publisher thread -------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                break
            self._send(*item)
        while True:  # what the loop queued before close() still goes out
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._send(*item)

    def _send(self, seq: int, ts: float, events: list) -> None:
        payload = encode_batch(events, ts, format=self.format)
        seq_bytes = seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart([self._topic, seq_bytes, payload], zmq.NOBLOCK)
        except zmq.Again:
            pass  # PUB drops for a full subscriber; it sees the gap and asks for a replay
        self.num_published += 1
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        try:
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV events replay request (%d frames)", len(frames))
            return
        identity = frames[0]
        start = int.from_bytes(frames[2], "big")
        if self._buffer and start < self._buffer[0][0] or not self._buffer and start < self._next_seq:
            self._resync.set()  # what it missed is gone: the loop publishes a full resync next
        try:
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            self._replay.send_multipart([identity, b"", END_OF_REPLAY, b""], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as e:
            log.warning("a KV events replay was cut short: %s", e)

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets; idempotent."""
        if self._pub is None:
            return
        self._stop.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        for ep in self._bound:  # an ipc socket's file outlives its socket
            if ep.startswith("ipc://"):
                try:
                    os.unlink(ep[len("ipc://"):])
                except OSError:
                    pass
