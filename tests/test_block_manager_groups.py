"""BlockManager with KV-cache groups (full and sliding-window layers sharing one pool).

A small driver plays the scheduler's part (admission with prefix hits, chunked prefill, decode
with the seed's tail preemption, finishing) over a model of the KV slabs: every block slot
records which token (by its whole prefix) and which group wrote it, and every query checks that
each key its layer group may read is in its table and holds exactly that token's KV. After
every step the manager's invariants hold, sliding groups hold at most ceil(W / block_size) + 1
blocks per decoding sequence, and when every request has ended every block is free."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpserve.blockpool import BlockManager
from tpserve.blockpool.kv_events import BlockRemoved, BlockStored, KVEventSink
from tpserve.kv_groups import (FULL, SLIDING, KVCacheGroup, group_size, kv_cache_groups,
                                         layer_slabs, max_window_blocks, window_start)
from tpserve.sampling import SamplingParams
from tpserve.scheduler import Sequence


# ---- groups from layer windows ----------------------------------------------------------------

def test_groups_follow_vllms_equal_size_split():
    # Gemma 3 1B's pattern: five sliding layers, then a global one.
    windows = [512 if (i + 1) % 6 else None for i in range(26)]
    groups = kv_cache_groups(windows)
    assert groups[0] == KVCacheGroup(FULL, None, (5, 11, 17, 23))
    assert [g.kind for g in groups[1:]] == [SLIDING] * 6 and all(g.window == 512 for g in groups[1:])
    assert sorted(i for g in groups for i in g.layers) == list(range(26))
    assert group_size(groups) == 4 and len(groups[-1].layers) == 2
    slabs = layer_slabs(groups, 26)
    assert slabs[5] == (0, 0) and slabs[0] == (1, 0) and slabs[25] == (6, 1)


@pytest.mark.parametrize("windows, expect", [
    ([], [KVCacheGroup()]),
    ([None] * 3, [KVCacheGroup(FULL, None, (0, 1, 2))]),
    ([8] * 3, [KVCacheGroup(SLIDING, 8, (0, 1, 2))]),
    ([8, None, 4, 8], [KVCacheGroup(FULL, None, (1,)), KVCacheGroup(SLIDING, 4, (2,)),
                       KVCacheGroup(SLIDING, 8, (0,)), KVCacheGroup(SLIDING, 8, (3,))]),
])
def test_group_layouts(windows, expect):
    assert kv_cache_groups(windows) == expect


def test_group_spec_is_checked():
    with pytest.raises(ValueError, match="kind"):
        KVCacheGroup("local", 4)
    with pytest.raises(ValueError, match="window"):
        KVCacheGroup(SLIDING, None)
    with pytest.raises(ValueError, match="window"):
        KVCacheGroup(SLIDING, 0)


def test_window_start_and_bound():
    assert window_start(512, 600, 16) == 5 and window_start(512, 100, 16) == 0
    assert max_window_blocks(512, 16) == 33 and max_window_blocks(5, 1) == 6 and max_window_blocks(5, 4) == 3


# ---- the driver -------------------------------------------------------------------------------

class Slabs:
    """What each block slot holds: (group, prefix of the token whose KV it is)."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.kv: dict[tuple[int, int], tuple[int, tuple]] = {}

    def write(self, seq, pos: int) -> None:
        bs = self.bm.block_size
        for g, table in enumerate(self.bm.tables(seq)):
            b = table[pos // bs]
            assert b != -1, f"group {g}: no block for position {pos}"
            self.kv[b, pos % bs] = (g, tuple(seq.token_ids[:pos + 1]))

    def read(self, seq, pos: int) -> None:
        """The query at ``pos`` reads exactly the keys its layers see, each the right KV."""
        bs = self.bm.block_size
        for g, table in enumerate(self.bm.tables(seq)):
            w = self.bm.groups[g].window
            for j in range(0 if w is None else max(0, pos - w + 1), pos + 1):
                b = table[j // bs]
                assert b != -1, f"group {g}: the query at {pos} reads key {j}, whose block is gone"
                assert self.kv.get((b, j % bs)) == (g, tuple(seq.token_ids[:j + 1])), \
                    f"group {g}: key {j} of the query at {pos} holds other KV (block {b})"


class Driver:
    def __init__(self, groups, num_blocks, bs, chunk, rng: random.Random, caching=True):
        self.bm = BlockManager(num_blocks, bs, caching, groups)
        self.bm.kv_events = KVEventSink()
        self.slabs = Slabs(self.bm)
        self.bs, self.chunk, self.rng = bs, chunk, rng
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.n = 0
        self.hit_blocks = 0
        self.max_held = 0

    def add(self, prompt) -> None:
        self.n += 1
        self.waiting.append(Sequence(f"r{self.n}", list(prompt), SamplingParams(max_tokens=8),
                                     block_size=self.bs))

    def _preempt(self, seq) -> None:
        self.bm.deallocate(seq)
        seq.is_prefill = True
        seq.num_cached_tokens = 0
        self.running.remove(seq)
        self.waiting.insert(0, seq)

    def step(self) -> None:
        bm, slabs = self.bm, self.slabs
        # decode: the seed's loop, tail preemption
        for seq in [s for s in self.running if not s.is_prefill]:
            if seq not in self.running:
                continue
            while not bm.can_append(seq):
                victims = [s for s in self.running if s is not seq]
                self._preempt(victims[-1] if victims else seq)
                if not victims:
                    break
            else:
                bm.may_append(seq)
                pos = len(seq) - 1
                slabs.write(seq, pos)
                slabs.read(seq, pos)
                seq.token_ids.append(self.rng.randrange(3))
                bm.hash_blocks(seq)
        # prefill: the partial one first, else admit the head of the queue
        partial = [s for s in self.running if s.is_prefill]
        if partial:
            seq = partial[0]
        elif self.waiting:
            seq = self.waiting[0]
            k = bm.can_allocate(seq)
            if k < 0:
                return
            self.waiting.pop(0)
            bm.allocate(seq, k)
            self.hit_blocks += k
            if seq.num_cached_tokens == len(seq):
                seq.num_cached_tokens = len(seq) - 1  # the last token is recomputed for its logits
            self.running.append(seq)
        else:
            return
        q = seq.num_cached_tokens
        end = min(len(seq), q + self.chunk)
        for pos in range(q, end):
            if pos >= seq.num_prefix_hit_tokens:  # a hit block's KV is never rewritten (slot -1)
                slabs.write(seq, pos)
        for pos in range(q, end):
            slabs.read(seq, pos)
        seq.num_cached_tokens = end
        bm.hash_blocks(seq)
        if end == len(seq):
            seq.token_ids.append(self.rng.randrange(3))
            seq.start_decoding()
            bm.hash_blocks(seq)

    def finish(self, i: int) -> None:
        if self.running:
            seq = self.running.pop(i % len(self.running))
            self.bm.deallocate(seq)

    def check(self) -> None:
        bm = self.bm
        bm.check_integrity()
        for seq in self.running:
            if seq.is_prefill:
                continue
            for g, table in enumerate(bm.tables(seq)):
                w = bm.groups[g].window
                if w is not None:
                    held = len(table) - table.count(-1)
                    self.max_held = max(self.max_held, held)
                    assert held <= max_window_blocks(w, self.bs)  # ceil(W / block_size) + 1

    def drain(self) -> None:
        for seq in list(self.running):
            self.running.remove(seq)
            self.bm.deallocate(seq)
        self.waiting.clear()
        bm = self.bm
        bm.check_integrity()
        assert bm.num_free_blocks == bm.num_blocks and not bm.used_block_ids
        assert all(b.ref_count == 0 for b in bm.blocks)


LAYOUTS = {
    "full+sliding": [None, 5, 5],
    "two windows": [3, None, 8, 3, None, 8],
    "all sliding": [6, 6],
    "full": [None, None],
}
PREFIXES = [[1, 2, 0, 1, 2, 2, 1, 0, 0, 2, 1, 1, 0, 2], [2, 2, 1, 0, 1]]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(sorted(LAYOUTS)), bs=st.sampled_from([1, 2, 4]),
       pool=st.integers(24, 80), chunk=st.integers(1, 12), caching=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from("aasssssssf"), st.integers(0, 50)), min_size=5, max_size=60))
def test_random_workloads_keep_the_invariants(layout, bs, pool, chunk, caching, ops):
    groups = kv_cache_groups(LAYOUTS[layout])
    d = Driver(groups, pool, bs, chunk, random.Random(pool * 131 + chunk), caching)
    for op, x in ops:
        if op == "a":
            prefix = PREFIXES[x % 2][:x % 15]
            tail = [x % 3] * (x % 5)
            prompt = prefix + tail or [x % 3]
            if -(-(len(prompt) + 8) // bs) * len(groups) <= pool:  # admission would refuse it
                d.add(prompt)
        elif op == "s":
            d.step()
        else:
            d.finish(x)
        d.check()
    for _ in range(40):
        d.step()
        d.check()
    d.drain()


@pytest.mark.parametrize("bs", [16, 1])
def test_long_decode_holds_at_most_the_window(bs):
    """Prompts and generations far longer than the window: the sliding group stays bounded and
    its blocks are reused; the full group holds everything."""
    w = 32
    groups = kv_cache_groups([w, None, w, w, w, w])  # 1 full, 5 sliding of one layer each
    d = Driver(groups, 4000 if bs == 1 else 400, bs, 24, random.Random(3))
    for p in range(3):
        d.add([p, 1, 2] * 30)
    for _ in range(200):
        d.step()
        d.check()
    assert all(len(s) > 150 for s in d.running)
    assert w // bs <= d.max_held <= w // bs + 1  # between steps: the bound, never more
    held = sum(len(t) - t.count(-1) for s in d.running for t in d.bm.tables(s))
    full = sum(len(s.block_table) for s in d.running)
    assert held < 2 * full  # six groups, yet under two full groups' worth of blocks
    d.drain()


def test_prefix_hit_after_the_window_moved():
    """A second request with the first one's prompt plus more: the sliding groups serve the hit
    from the blocks still in their window; the blocks before it are not needed."""
    bs, w = 4, 8
    groups = kv_cache_groups([None, w])
    d = Driver(groups, 200, bs, 100, random.Random(1))
    prompt = [1, 2, 0, 2] * 10  # 40 tokens, 10 blocks
    d.add(prompt)
    d.step()  # the whole prompt in one chunk; the sliding group keeps its window only
    first = d.running[0]
    sliding = d.bm.tables(first)[1]
    start = window_start(w, 40, bs)  # the next query is at 40
    assert start == 8 and sliding[:start] == [-1] * start and -1 not in sliding[start:]
    d.finish(0)
    d.add(prompt + [0, 1])
    d.step()
    second = d.running[0]
    assert second.num_prefix_hit_tokens == 40  # every block: the window's blocks are cached
    full, sliding = d.bm.tables(second)
    assert -1 not in full and sliding[:window_start(w, 40, bs)] == [-1] * window_start(w, 40, bs)
    for _ in range(5):
        d.step()
        d.check()
    d.drain()


def test_hit_is_cut_where_a_sliding_block_was_reused():
    bs, w = 2, 4
    groups = kv_cache_groups([None, w])
    bm = BlockManager(64, bs, True, groups)
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(), block_size=bs)
    k = bm.can_allocate(a)
    bm.allocate(a, k)
    a.num_cached_tokens = len(a)
    bm.hash_blocks(a)
    held = bm.tables(a)[1]
    assert held[:window_start(w, 9, bs)] == [-1] * 2
    bm.deallocate(a)
    # the sliding group's block 3 is evicted: a hit of 4 blocks would read it, 3 blocks would not
    victim = bm.group_hashes[1][a.block_hashes[3]]
    del bm.group_hashes[1][a.block_hashes[3]]
    bm._free.uncache(victim)
    bm.blocks[victim].hash = -1
    bm.check_integrity()
    b = Sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 9], SamplingParams(), block_size=bs)
    k, hits = bm.group_hits(b)
    assert k == 3  # blocks 1 and 2 cover the window of the query at position 6
    assert hits[1] == [-1, bm.group_hashes[1][a.block_hashes[1]], bm.group_hashes[1][a.block_hashes[2]]]
    assert bm.can_allocate(b) == 3


def test_events_name_the_group():
    bs = 2
    groups = kv_cache_groups([None, 4])
    bm = BlockManager(8, bs, True, groups)
    bm.kv_events = sink = KVEventSink()
    a = Sequence("a", [1, 2, 3, 4], SamplingParams(), block_size=bs)
    bm.allocate(a, bm.can_allocate(a))
    a.num_cached_tokens = 4
    bm.hash_blocks(a)
    stored = sink.drain()
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored] == \
        [(0, FULL, None), (1, SLIDING, 4)]
    assert all(isinstance(e, BlockStored) and e.block_hashes == a.block_hashes for e in stored)
    bm.deallocate(a)
    c = Sequence("c", [7] * 8, SamplingParams(), block_size=bs)
    bm.allocate(c, bm.can_allocate(c))  # takes all 8 blocks: every cached one is evicted
    removed = sink.drain()
    assert {(e.group_idx, tuple(e.block_hashes)) for e in removed} == \
        {(g, (h,)) for g in (0, 1) for h in a.block_hashes}
    assert all(isinstance(e, BlockRemoved) for e in removed)


@pytest.mark.parametrize("layout", ["full+sliding", "two windows"])
def test_events_replay_to_each_groups_index_and_resync_lists_every_group(layout):
    from tpserve.blockpool.kv_events import AllBlocksCleared, resync_events
    groups = kv_cache_groups(LAYOUTS[layout])
    d = Driver(groups, 40, 2, 5, random.Random(7))
    views: dict[int, set] = {g: set() for g in range(len(groups))}
    rng = random.Random(5)
    for i in range(120):
        if i % 6 == 0:
            d.add(PREFIXES[i % 2][:rng.randrange(15)] + [rng.randrange(3)] * rng.randrange(4))
        if i % 9:
            d.step()
        else:
            d.finish(i)
        for e in d.bm.kv_events.drain():
            assert not isinstance(e, AllBlocksCleared)
            if isinstance(e, BlockStored):
                views[e.group_idx].update(e.block_hashes)
            else:
                views[e.group_idx].difference_update(e.block_hashes)
        assert all(views[g] == set(d.bm.group_hashes[g]) for g in views)
    assert len(set(d.bm.group_hashes[1])) > 0
    events = resync_events(d.bm.cached_blocks(), 2, (), d.bm.group_cached_blocks())
    rebuilt: dict[int, set] = {g: set() for g in views}
    for e in events[1:]:
        rebuilt[e.group_idx].update(e.block_hashes)
        assert e.kv_cache_spec_sliding_window == groups[e.group_idx].window
    assert rebuilt == views
    d.drain()


def test_a_pooling_sequence_past_the_window_frees_every_block():
    bs = 2
    bm = BlockManager(64, bs, True, kv_cache_groups([None, 4]))
    a = Sequence("a", list(range(1, 20)), SamplingParams(), block_size=bs)
    a.pooling = "MEAN"  # its blocks past the prefix hit go to the front of the eviction order
    bm.allocate(a, bm.can_allocate(a))
    a.num_cached_tokens = len(a)
    bm.hash_blocks(a)
    assert bm.tables(a)[1][:7] == [-1] * 7
    bm.deallocate(a)
    bm.check_integrity()
    assert bm.num_free_blocks == 64 and all(b.ref_count == 0 for b in bm.blocks)
