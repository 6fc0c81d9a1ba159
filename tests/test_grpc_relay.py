"""The gRPC front's KV-event relay (tpserve.fronts.grpc.kv_relay): the daemon's events, served as
smg's KvEventBatch stream.

The central property, as for the daemon's own stream (test_kv_events.py): a subscriber that
applies the relayed batches in order -- from the start, from a snapshot, or resumed from any
sequence it had reached -- holds exactly the keys of ``hash_to_block_id`` (as the proto's int64
hashes), through requests, prefix hits, preemptions, evictions, resets and lost events."""
from __future__ import annotations

import asyncio
import time

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import common_pb2 as C

from test_kv_events import _free_tcp, op_st, run_op
from test_scheduler_properties import Harness
from tpserve.blockpool import BlockManager
from tpserve.blockpool.kv_events import BlockRemoved, BlockStored, KVEventSink, resync_events
from tpserve.server.kv_events import KVEventPublisher, encode_batch
from tpserve.fronts.grpc.kv_relay import KvEventsFeed, KvRelay, decode_events, wire_hash


class ProtoView:
    """What smg's index keeps of one worker: block hash -> (parent, tokens), from KvEventBatch."""

    def __init__(self):
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.last_seq = 0

    def apply(self, batch: C.KvEventBatch) -> None:
        assert self.last_seq == 0 or batch.sequence_number == self.last_seq + 1, \
            (self.last_seq, batch.sequence_number)
        self.last_seq = batch.sequence_number
        for ev in batch.events:
            kind = ev.WhichOneof("data")
            if kind == "stored":
                parent = ev.stored.parent_block_hash if ev.stored.HasField("parent_block_hash") else None
                for b in ev.stored.blocks:
                    assert len(b.token_ids) == b.block_size
                    self.blocks[b.block_hash] = (parent, tuple(b.token_ids))
                    parent = b.block_hash
            elif kind == "removed":
                for h in ev.removed.block_hashes:
                    self.blocks.pop(h, None)
            else:
                assert kind == "cleared"
                self.blocks.clear()

    def drain(self, sub) -> None:
        for b in sub.initial:
            self.apply(b)
        sub.initial = []
        while not sub.queue.empty():
            b = sub.queue.get_nowait()
            assert b is not None, "the subscriber overflowed"
            self.apply(b)


def expected(bm: BlockManager) -> set[int]:
    return {wire_hash(h) for h in bm.hash_to_block_id}


def relay_batch(relay: KvRelay, events, seq: int) -> None:
    """The daemon's batch through the wire format and back, as the feed does it."""
    ts, decoded = decode_events(encode_batch(events, time.time()))
    relay.apply(seq, ts, decoded)


def test_hashes_become_int64_and_zero_is_not_sent():
    assert wire_hash(5) == 5
    assert wire_hash(2**63 - 1) == 2**63 - 1
    assert wire_hash(2**63) == -2**63
    assert wire_hash(2**64 - 1) == -1
    assert wire_hash(0) == 1


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_both_payload_formats_decode_to_the_same_events(fmt):
    events = [BlockStored([1, 2], None, list(range(8)), 4), BlockRemoved([1]), resync_events([], 4)[0]]
    ts, got = decode_events(encode_batch(events, 12.5, format=fmt))
    assert ts == 12.5
    assert got == [("stored", [1, 2], None, list(range(8)), 4), ("removed", [1]), ("cleared",)]


def _loop():
    """Subscribers hold asyncio queues: give the test an event loop."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    return loop


@pytest.fixture
def event_loop_set():
    loop = _loop()
    yield loop
    loop.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bs=st.sampled_from([1, 2, 4]), pool_tokens=st.integers(6, 32), max_num_seqs=st.sampled_from([1, 2, 4]),
       max_batched=st.integers(1, 16), salt=st.integers(0, 1000), ops=st.lists(op_st, min_size=1, max_size=40),
       history=st.sampled_from([2, 5, 1000]), resume_every=st.integers(1, 7))
def test_every_subscriber_rebuilds_exactly_the_cached_hashes(bs, pool_tokens, max_num_seqs, max_batched, salt,
                                                             ops, history, resume_every):
    """A live subscriber from the start, a new one from the current state after every few
    operations, and one that resumes from a sequence it had (from the history, or as a
    chunked snapshot when the history is too short): all hold the cache's hashes."""
    loop = _loop()
    try:
        blocks = -(-pool_tokens // bs)
        h = Harness(bs, blocks, max_num_seqs, max_batched, 40, True, vocab=6, salt=salt, policy="mixed")
        bm = h.s.block_manager
        bm.kv_events = sink = KVEventSink(capacity=8)
        relay = KvRelay(history=history)
        live, live_view = relay.subscribe(0), ProtoView()
        resumer, resumer_view = relay.subscribe(0), ProtoView()
        seq = 0
        for i, op in enumerate(ops):
            run_op(h, sink, op, blocks, bs)
            events = sink.drain()
            if sink.take_overflow():
                events = resync_events(bm.cached_blocks(), bs)
            if events:
                seq += 1
                relay_batch(relay, events, seq)
            live_view.drain(live)
            assert set(live_view.blocks) == expected(bm)
            if i % resume_every == 0:
                # The resumer was away since its last drain: it reconnects from its last sequence.
                relay.unsubscribe(resumer)
                resumer = relay.subscribe(resumer_view.last_seq)
                resumer_view.drain(resumer)
                assert set(resumer_view.blocks) == expected(bm)
            fresh_view = ProtoView()
            fresh_view.drain(relay.subscribe(0))
            assert set(fresh_view.blocks) == expected(bm)
            assert fresh_view.blocks == live_view.blocks  # parents and tokens too
        assert relay.seq == seq
    finally:
        loop.close()


def test_a_resume_inside_the_history_gets_the_very_batches_and_an_older_one_a_contiguous_snapshot(event_loop_set):
    relay = KvRelay(history=3)
    for s in range(1, 7):
        relay_batch(relay, [BlockStored([100 + s], 100 + s - 1 if s > 1 else None, [s] * 2, 2)], s)
    initial = list(relay.subscribe(4).initial)
    assert [b.sequence_number for b in initial] == [5, 6]
    assert all(not b.HasField("snapshot") for b in initial)
    initial = list(relay.subscribe(1).initial)  # batches 2 and 3 are gone from the history
    assert [b.sequence_number for b in initial] == [2, 3, 4, 5, 6]
    assert [b.snapshot.index for b in initial] == [0, 1, 2, 3, 4]
    assert {b.snapshot.count for b in initial} == {5}
    first = initial[0]
    assert first.events[0].WhichOneof("data") == "cleared"
    stored = [e.stored for e in first.events[1:]]
    assert [s.blocks[0].block_hash for s in stored] == [101, 102, 103, 104, 105, 106]  # parents first
    assert [s.parent_block_hash if s.HasField("parent_block_hash") else None for s in stored] == \
        [None, 101, 102, 103, 104, 105]
    assert all(not b.events for b in initial[1:])
    assert list(relay.subscribe(6).initial) == []
    (snap,) = relay.subscribe(0).initial
    assert snap.sequence_number == 6 and len(snap.events) == 7
    assert list(KvRelay().subscribe(0).initial) == []  # nothing yet: nothing to send


def test_a_subscriber_that_falls_behind_is_ended_and_counted_and_the_others_are_not(event_loop_set):
    relay = KvRelay(queue_size=3)
    slow, fast = relay.subscribe(0), relay.subscribe(0)
    fast_view = ProtoView()
    for s in range(1, 6):
        relay_batch(relay, [BlockStored([s], None, [s], 1)], s)
        fast_view.drain(fast)
    assert relay.num_overflowed == 1 and slow.overflowed and not fast.overflowed
    got = []
    while not slow.queue.empty():
        got.append(slow.queue.get_nowait())
    assert got[-1] is None and len(got) == 3  # then the stream ends
    assert set(fast_view.blocks) == {1, 2, 3, 4, 5}
    assert relay.stats()["kv_relay_overflowed"] == 1


def test_the_feed_reads_what_was_published_before_it_started_then_live_batches():
    """Three batches published before the feed connects come from the replay socket; the next
    ones from PUB; a batch the PUB stream lost is fetched from the replay socket."""
    pub = KVEventPublisher(_free_tcp(), _free_tcp())
    try:
        for s in range(3):
            pub.publish([BlockStored([10 + s], 10 + s - 1 if s else None, [s], 1)])
        time.sleep(0.2)

        async def run():
            relay = KvRelay()
            feed = KvEventsFeed(relay, pub.endpoint, pub.replay_endpoint, context=zmq.asyncio.Context())
            task = asyncio.create_task(feed.run())
            try:
                deadline = time.monotonic() + 10
                while relay.seq < 3:
                    assert time.monotonic() < deadline, relay.seq
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.3)  # the SUB subscription is up
                pub.publish([BlockStored([13], 12, [3], 1)])
                pub.publish([BlockRemoved([10])])
                while relay.seq < 5:
                    assert time.monotonic() < deadline, relay.seq
                    await asyncio.sleep(0.02)
                # A lost PUB message: batch 5 is only in the replay buffer; batch 6 shows the gap.
                real = pub._pub
                dropped = []

                class DropOne:
                    def send_multipart(self, frames, flags=0):
                        if not dropped:
                            dropped.append(frames)
                            return None
                        return real.send_multipart(frames, flags)

                    def close(self, linger=None):
                        real.close(linger=linger)
                pub._pub = DropOne()
                pub.publish([BlockStored([14], 13, [4], 1)])
                pub.publish([BlockStored([15], 14, [5], 1)])
                while relay.seq < 7:
                    assert time.monotonic() < deadline, relay.seq
                    await asyncio.sleep(0.02)
                assert dropped
                return relay, feed
            finally:
                task.cancel()
        relay, feed = asyncio.run(run())
        assert set(relay.blocks) == {11, 12, 13, 14, 15}
        assert feed.num_skipped == 0
    finally:
        pub.close()


def test_a_gap_the_replay_buffer_cannot_fill_waits_for_the_daemons_resync(event_loop_set):
    """Batches missing beyond the replay buffer: the feed skips to the daemon's resync batch
    (it starts with AllBlocksCleared) and the relay's state is exact again."""
    relay = KvRelay()
    feed = KvEventsFeed(relay, "inproc://unused", "inproc://unused")
    feed._take(0, encode_batch([BlockStored([1], None, [1], 1)], 1.0))
    feed._take(5, encode_batch([BlockStored([9], None, [9], 1)], 1.0))  # 1..4 lost
    assert relay.seq == 1 and feed._pending
    feed._after_replay()  # the replay had nothing older: wait for a resync
    assert feed._waiting_resync
    feed._take(6, encode_batch([BlockRemoved([9])], 1.0))  # not a resync: skipped
    feed._take(7, encode_batch(resync_events([(2, None, [2]), (3, 2, [3])], 1), 1.0))
    assert not feed._waiting_resync and feed.num_skipped == 6
    assert set(relay.blocks) == {2, 3} and relay.seq == 8
    feed._take(8, encode_batch([BlockStored([4], 3, [4], 1)], 1.0))
    assert set(relay.blocks) == {2, 3, 4} and relay.seq == 9
