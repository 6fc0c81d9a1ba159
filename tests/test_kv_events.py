"""KV-cache events: the BlockManager's record of what enters and leaves the prefix cache, and
the daemon's publisher of them in vLLM's wire format.

The central property: a subscriber that replays the events onto an empty set always holds
exactly the keys of ``hash_to_block_id``, through requests, prefix hits, preemptions,
evictions, resets and lost events (which are repaired by a resync)."""
from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_daemon import ServerThread
from test_scheduler_properties import Harness, add_st
from tpserve.blockpool import BlockManager
from tpserve.blockpool.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventSink,
                                         resync_events)
from tpserve.server.kv_events import END_OF_REPLAY, KVEventPublisher, KVEventsOptions, encode_batch
from tpserve.client.addresses import InsecureAddressError
from tpserve.server.server import ServerOptions
from tpserve.sampling import SamplingParams
from tpserve.scheduler import Sequence


# ---- vLLM's wire types, as a vLLM-format consumer declares them with msgspec: the batch a
# positional array, each event a struct tagged by its class name; current vLLM encodes an event
# as a map (tag under "type"), earlier releases as a positional array (tpserve's format="array").
class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


def _event_types(array_like: bool) -> msgspec.msgpack.Decoder:
    """A decoder of vLLM's batch whose events are maps (or, ``array_like``, arrays)."""
    base = msgspec.defstruct("Event", [], array_like=array_like, omit_defaults=True, gc=False, tag=True)
    stored = msgspec.defstruct("VBlockStored", [
        ("block_hashes", list[int]), ("parent_block_hash", int | None), ("token_ids", list[int]),
        ("block_size", int), ("lora_id", int | None), ("medium", str | None), ("lora_name", str | None)],
        bases=(base,), tag="BlockStored")
    removed = msgspec.defstruct("VBlockRemoved", [("block_hashes", list[int]), ("medium", str | None)],
                                bases=(base,), tag="BlockRemoved")
    cleared = msgspec.defstruct("VAllBlocksCleared", [], bases=(base,), tag="AllBlocksCleared")
    batch = msgspec.defstruct("VKVEventBatch", [("events", list[stored | removed | cleared])], bases=(_Batch,))
    return msgspec.msgpack.Decoder(batch)


DECODER, ARRAY_DECODER = _event_types(False), _event_types(True)


class CacheView:
    """A subscriber's view: the set of cached block hashes, rebuilt from events."""

    def __init__(self, block_size: int | None = None):
        self.hashes: set[int] = set()
        self.block_size = block_size

    def apply(self, events) -> None:
        for e in events:
            name = type(e).__name__.lstrip("V")
            if name == "BlockStored":
                self.check_chain(e)
                self.hashes.update(e.block_hashes)
            elif name == "BlockRemoved":
                self.hashes.difference_update(e.block_hashes)
            else:
                assert name == "AllBlocksCleared", name
                self.hashes.clear()

    def check_chain(self, e) -> None:
        """Each stored hash is the chained xxh64 of its tokens after its parent."""
        bs = e.block_size
        assert self.block_size in (None, bs)
        assert len(e.token_ids) == bs * len(e.block_hashes)
        prev = -1 if e.parent_block_hash is None else e.parent_block_hash
        for k, h in enumerate(e.block_hashes):
            assert h == BlockManager.compute_hash(e.token_ids[k * bs:(k + 1) * bs], prev)
            prev = h


def seq(tokens, bs, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4), block_size=bs)


def admit_and_compute(bm, s):
    n = bm.can_allocate(s)
    assert n >= 0
    bm.allocate(s, n)
    s.num_cached_tokens = len(s)
    bm.hash_blocks(s)


# ---- the BlockManager's events ---------------------------------------------------------------

def test_no_sink_records_nothing_and_a_sink_records_stored_blocks_with_parent_and_tokens():
    bm = BlockManager(8, 4)
    admit_and_compute(bm, seq(range(10), 4, "a"))
    assert bm.kv_events is None
    bm = BlockManager(8, 4)
    bm.kv_events = sink = KVEventSink()
    a = seq(range(10), 4, "a")
    admit_and_compute(bm, a)
    h0, h1 = a.block_hashes[:2]
    assert sink.drain() == [BlockStored([h0, h1], None, list(range(8)), 4)]
    b = seq([0, 1, 2, 3, 9, 9, 9, 9], 4, "b")  # block 0 is a hit: only block 1 is new
    admit_and_compute(bm, b)
    assert sink.drain() == [BlockStored([b.block_hashes[1]], h0, [9, 9, 9, 9], 4)]


def test_eviction_records_removed_and_a_takeover_records_nothing():
    bm = BlockManager(3, 2)
    bm.kv_events = sink = KVEventSink()
    a = seq([1, 2, 3, 4], 2, "a")
    admit_and_compute(bm, a)
    bm.deallocate(a)
    sink.drain()
    # Same contents computed again while the first copy is in use elsewhere: a takeover.
    c1, c2 = seq([7, 8], 2, "c1"), seq([7, 8], 2, "c2")
    bm.allocate(c1, 0)
    bm.allocate(c2, 0)  # no plain block left: evicts a's tail block, freed first (its hash goes)
    assert sink.drain() == [BlockRemoved([a.block_hashes[1]])]
    c1.num_cached_tokens = c2.num_cached_tokens = 2
    bm.hash_blocks(c1)
    bm.hash_blocks(c2)
    assert sink.drain() == [BlockStored([c1.block_hashes[0]], None, [7, 8], 2)]
    view = CacheView()
    view.apply(resync_events(bm.cached_blocks(), 2))
    assert view.hashes == set(bm.hash_to_block_id)


def test_reset_prefix_cache_records_cleared_or_the_removed_hashes():
    bm = BlockManager(8, 2)
    bm.kv_events = sink = KVEventSink()
    a, b = seq([1, 2, 3, 4], 2, "a"), seq([5, 6], 2, "b")
    admit_and_compute(bm, a)
    admit_and_compute(bm, b)
    bm.deallocate(a)
    sink.drain()
    assert bm.reset_prefix_cache() is False  # b's block is still held
    (removed,) = sink.drain()
    assert isinstance(removed, BlockRemoved) and set(removed.block_hashes) == set(a.block_hashes[:2])
    bm.deallocate(b)
    assert bm.reset_prefix_cache() is True
    assert sink.drain() == [AllBlocksCleared()]
    assert bm.reset_prefix_cache() is True and sink.drain() == []  # nothing left: no event


def test_overflow_drops_the_oldest_and_asks_for_a_resync():
    sink = KVEventSink(capacity=2)
    for i in range(5):
        sink.add(BlockRemoved([i]))
    assert sink.num_dropped == 3 and sink.drain() == [BlockRemoved([3]), BlockRemoved([4])]
    assert sink.take_overflow() is True and sink.take_overflow() is False


def test_cached_blocks_lists_parents_first_with_their_hashes():
    bm = BlockManager(16, 2)
    a = seq([1, 2, 3, 4, 5, 6], 2, "a")
    b = seq([1, 2, 3, 4, 9, 9], 2, "b")
    admit_and_compute(bm, a)
    admit_and_compute(bm, b)
    listed = bm.cached_blocks()
    order = [h for h, _, _ in listed]
    assert set(order) == set(bm.hash_to_block_id)
    for h, parent, tokens in listed:
        if parent is not None:
            assert order.index(parent) < order.index(h)
        assert h == BlockManager.compute_hash(tokens, -1 if parent is None else parent)
    assert sum(parent is None for _, parent, _ in listed) == 1


op_st = st.one_of(add_st, add_st, st.tuples(st.just("step")), st.tuples(st.just("step")),
                  st.tuples(st.just("step")), st.tuples(st.just("abort"), st.integers(0, 50)),
                  st.tuples(st.just("preempt"), st.integers(0, 50)), st.tuples(st.just("reset")),
                  st.tuples(st.just("lose")))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A resync after the block [3] left the cache while its child [1] stayed: the child names it.
@example(bs=1, pool_tokens=8, max_num_seqs=1, max_batched=1, policy="mixed", salt=0,
         ops=[("add", [3], 1, False, [], 0, 0, None), ("add", [3, 1, 4, 1, 5, 2, 6], 2, False, [], 0, 0, None),
              ("add", [3, 1], 2, False, [], 0, 0, None)])
@given(bs=st.sampled_from([1, 2, 3, 4]), pool_tokens=st.integers(6, 32),
       max_num_seqs=st.sampled_from([1, 2, 3, 4]), max_batched=st.integers(1, 16),
       policy=st.sampled_from(["mixed", "prefill-first"]), salt=st.integers(0, 1000),
       ops=st.lists(op_st, min_size=1, max_size=50))
def test_replayed_events_always_equal_the_cached_hashes(bs, pool_tokens, max_num_seqs, max_batched,
                                                        policy, salt, ops):
    """Random requests, steps, aborts, preemptions, resets and lost events (a sink overflow,
    repaired by a resync): after every operation the view equals hash_to_block_id's keys."""
    blocks = -(-pool_tokens // bs)
    h = Harness(bs, blocks, max_num_seqs, max_batched, 40, True, vocab=6, salt=salt, policy=policy)
    bm = h.s.block_manager
    bm.kv_events = sink = KVEventSink(capacity=8)
    view = CacheView(bs)

    def sync():
        events = sink.drain()
        if sink.take_overflow():
            events = resync_events(bm.cached_blocks(), bs)
        view.apply(events)
        assert view.hashes == set(bm.hash_to_block_id)

    for op in ops:
        run_op(h, sink, op, blocks, bs)
        sync()
    h.drain()
    sync()


def run_op(h: Harness, sink: KVEventSink, op: tuple, blocks: int, bs: int) -> None:
    """One operation of ``op_st`` on the harness (a request's length capped to what fits)."""
    if op[0] == "add":
        _, prompt, max_tokens, ignore_eos, stop_ids = op[:5]
        max_tokens = min(max_tokens, 40 - len(prompt), blocks * bs + 1 - len(prompt))
        if max_tokens >= 1:
            h.add(prompt, max_tokens, ignore_eos, stop_ids)
    elif op[0] == "step":
        if h.s.has_unfinished():
            h.step()
    elif op[0] == "abort":
        h.abort(op[1])
    elif op[0] == "preempt":
        h.preempt(op[1])
    elif op[0] == "reset":
        h.s.block_manager.reset_prefix_cache()
    else:
        for i in range(sink.capacity + 1):  # more than the sink holds: events are lost
            sink.add(BlockRemoved([i]))


# ---- the wire format and the publisher --------------------------------------------------------

@pytest.mark.parametrize("fmt,decoder", [("map", DECODER), ("array", ARRAY_DECODER)])
def test_the_payload_decodes_with_vllms_struct_definitions(fmt, decoder):
    events = [BlockStored([2**64 - 1, 7], None, [1, 2, 3, 4], 2), BlockRemoved([7]), AllBlocksCleared()]
    payload = encode_batch(events, 12.5, format=fmt)
    batch = decoder.decode(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size,
            stored.lora_id, stored.medium, stored.lora_name) == ([2**64 - 1, 7], None, [1, 2, 3, 4], 2,
                                                                 None, "GPU", None)
    assert (removed.block_hashes, removed.medium) == ([7], "GPU")
    assert type(cleared).__name__ == "VAllBlocksCleared"
    other = ARRAY_DECODER if decoder is DECODER else DECODER
    with pytest.raises(msgspec.ValidationError):  # the two layouts are not interchangeable
        other.decode(payload)
    with pytest.raises(ValueError, match="format"):
        KVEventsOptions("tcp://127.0.0.1:5557", format="json")


def test_non_loopback_endpoints_are_refused_unless_allowed():
    with pytest.raises(InsecureAddressError, match="prompt token ids"):
        KVEventsOptions("tcp://*:5557")
    with pytest.raises(InsecureAddressError):
        KVEventsOptions("tcp://127.0.0.1:5557", replay_endpoint="tcp://0.0.0.0:5558")
    with pytest.raises(ValueError, match="must be tcp"):
        KVEventsOptions("udp://127.0.0.1:5557")
    KVEventsOptions("tcp://*:5557", allow_remote=True)  # no error


class Subscriber:
    """A SUB socket (and a DEALER for replays: a REQ would take only the first of the replayed
    messages) collecting (seq, batch) in the background."""

    def __init__(self, endpoint: str, replay: str | None = None, topic: bytes = b""):
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.req = None
        if replay:
            self.req = ctx.socket(zmq.DEALER)
            self.req.setsockopt(zmq.LINGER, 0)
            self.req.connect(replay)
        self.got: list[tuple[int, VKVEventBatch]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if self.sub.poll(20):
                topic, seq, payload = self.sub.recv_multipart()
                self.got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))

    def wait_for(self, seq: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(s == seq for s, _ in self.got):
            assert time.monotonic() < deadline, f"batch {seq} never arrived; got {[s for s, _ in self.got]}"
            time.sleep(0.01)

    def replay(self, start: int) -> list[tuple[int, VKVEventBatch]]:
        self.req.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert self.req.poll(5000), "no replay answer"
            empty, seq, payload = self.req.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))

    def close(self):
        self._stop.set()
        self._thread.join(2)
        self.sub.close(0)
        if self.req is not None:
            self.req.close(0)


def _free_tcp() -> str:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_publisher_numbers_batches_replays_them_and_asks_for_a_resync_when_behind():
    pub = KVEventPublisher(_free_tcp(), replay_endpoint=_free_tcp(), topic="kv", buffer_steps=3)
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, topic=b"kv")
    try:
        time.sleep(0.3)  # PUB drops what it sends before the subscription has arrived
        pub.publish([])  # nothing to say: no batch, no number
        for i in range(5):
            pub.publish([BlockRemoved([i])])
        sub.wait_for(4)
        assert [s for s, _ in sub.got] == [0, 1, 2, 3, 4]
        assert [b.events[0].block_hashes for _, b in sub.got] == [[i] for i in range(5)]
        assert pub.resync_wanted() is False
        assert [s for s, _ in sub.replay(3)] == [3, 4]
        assert pub.resync_wanted() is False
        assert [s for s, _ in sub.replay(0)] == [2, 3, 4]  # 0 and 1 left the buffer
        assert pub.resync_wanted() is True and pub.resync_wanted() is False
        assert pub.stats() == {"kv_events_published": 5, "kv_events_dropped": 0, "kv_events_next_seq": 5}
    finally:
        sub.close()
        pub.close()


def test_a_full_queue_drops_the_batch_counts_it_and_asks_for_a_resync(monkeypatch):
    """A publisher thread that cannot keep up never blocks publish(): the batch is dropped."""
    release, sending = threading.Event(), threading.Event()
    send = KVEventPublisher._send

    def stalled(self, *item):
        sending.set()
        assert release.wait(10)
        send(self, *item)
    monkeypatch.setattr(KVEventPublisher, "_send", stalled)
    pub = KVEventPublisher(_free_tcp(), max_queue=1)
    try:
        pub.publish([BlockRemoved([0])])  # taken by the thread, which stalls sending it
        assert sending.wait(5)
        pub.publish([BlockRemoved([1])])  # fills the queue
        assert pub.resync_wanted() is False
        pub.publish([BlockRemoved([2])])  # no room: dropped
        assert pub.num_dropped == 1 and pub.resync_wanted() is True
        assert pub.stats()["kv_events_next_seq"] == 3  # its number is spent: subscribers see a gap
    finally:
        release.set()
        pub.close()
    assert pub.num_published == 2


# ---- end to end: a real engine behind the daemon's loop ---------------------------------------

def test_a_subscriber_of_a_serving_daemon_holds_exactly_the_cached_hashes(tiny_models_root):  # noqa: F811
    """Requests sharing prefixes on a pool too small for all of them (prefix hits, preemptions
    and evictions), then a prefix-cache reset: the subscriber's set equals the keys of the
    engine's hash_to_block_id, and the numbers of its batches have no gap."""
    from tpserve.config import EngineConfig
    import asyncio

    from tpserve.client.client import AsyncClient
    from tpserve.engine import Engine

    path = make_tiny_model(tiny_models_root)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=14, block_size=4,
                                 max_num_seqs=4, max_num_batched_tokens=32))
    opts = ServerOptions(kv_events=KVEventsOptions(_free_tcp(), replay_endpoint=_free_tcp()))
    server = ServerThread(engine, opts)
    sub = Subscriber(opts.kv_events.endpoint, opts.kv_events.replay_endpoint)
    try:
        time.sleep(0.3)
        base = list(range(5, 25))
        prompts = [base + [40 + i] * (3 + i) for i in range(4)] + [base[:9] + [60, 61, 62, 63]]
        sp = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)

        async def run():
            async with AsyncClient(server.address, timeout=60) as client:
                for _ in range(2):
                    await asyncio.gather(*(client.generate(p, sp) for p in prompts))
                return await client.status()
        stats = asyncio.run(run())
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
        last = stats["kv_events_next_seq"] - 1
        sub.wait_for(last)
        view = CacheView(4)
        seqs = [s for s, _ in sub.got]
        assert seqs == list(range(last + 1)), "a batch is missing"
        for _, batch in sub.got:
            view.apply(batch.events)
        bm = engine.scheduler.block_manager
        assert view.hashes == set(bm.hash_to_block_id) and view.hashes
        assert any(type(e).__name__ == "VBlockRemoved" for _, b in sub.got for e in b.events), \
            "the pool never evicted a cached block"
        replayed = sub.replay(0)
        assert [s for s, _ in replayed] == seqs
    finally:
        sub.close()
        server.stop()
        engine.shutdown()
