"""BlockManager: allocation order, ref counts, chained-hash prefix cache, eviction, integrity."""
from __future__ import annotations

import pytest

from tpserve.blockpool import Block, BlockManager
from tpserve.sampling import SamplingParams
from tpserve.scheduler import Sequence


def make_seq(tokens, block_size, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4), block_size=block_size)


def admit(bm: BlockManager, seq) -> int:
    """Allocate like the scheduler does; returns the number of cached blocks."""
    n = bm.can_allocate(seq)
    assert n >= 0
    bm.allocate(seq, n)
    return n


def computed(bm: BlockManager, seq) -> None:
    """Pretend the prefill ran: all prompt KV is written, full blocks become cacheable."""
    seq.num_cached_tokens = len(seq)
    bm.hash_blocks(seq)


# ---- hashing -------------------------------------------------------------------------------

def test_compute_hash_is_chained_and_deterministic():
    a = BlockManager.compute_hash([1, 2, 3, 4])
    assert a == BlockManager.compute_hash([1, 2, 3, 4], -1)
    assert a != BlockManager.compute_hash([1, 2, 3, 5])
    assert BlockManager.compute_hash([5, 6], a) != BlockManager.compute_hash([5, 6])
    assert BlockManager.compute_hash([5, 6], a) == BlockManager.compute_hash([5, 6], a)
    assert a >= 0


def test_hash_blocks_only_hashes_full_written_blocks():
    bm = BlockManager(8, 4)
    seq = make_seq(range(10), 4)
    admit(bm, seq)
    assert seq.block_table == [0, 1, 2]
    seq.num_cached_tokens = 5           # only block 0 is fully written
    bm.hash_blocks(seq)
    assert [b.hash != -1 for b in bm.blocks[:3]] == [True, False, False]
    seq.num_cached_tokens = 10          # block 2 holds 2 of 4 tokens: never hashed
    bm.hash_blocks(seq)
    assert [b.hash != -1 for b in bm.blocks[:3]] == [True, True, False]
    h0 = BlockManager.compute_hash([0, 1, 2, 3])
    h1 = BlockManager.compute_hash([4, 5, 6, 7], h0)
    assert bm.hash_to_block_id == {h0: 0, h1: 1}
    assert bm.blocks[1].token_ids == [4, 5, 6, 7]
    bm.check_integrity()


def test_prefix_caching_disabled_never_hashes_or_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(range(8), 4, "a")
    admit(bm, a)
    computed(bm, a)
    assert bm.hash_to_block_id == {}
    b = make_seq(range(8), 4, "b")
    assert admit(bm, b) == 0
    assert b.block_table == [2, 3]
    bm.check_integrity()


# ---- allocation and ref counts -------------------------------------------------------------

def test_allocate_deallocate_order_and_ref_counts():
    bm = BlockManager(6, 4)
    seq = make_seq(range(9), 4)
    assert bm.can_allocate(seq) == 0
    admit(bm, seq)
    assert seq.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(6)] == [1, 1, 1, 0, 0, 0]
    assert list(bm.free_block_ids) == [3, 4, 5]
    assert bm.used_block_ids == {0, 1, 2}
    bm.check_integrity()
    bm.deallocate(seq)
    # Reverse order: the tail block is freed first. Nothing was hashed, so all are plain.
    assert list(bm.free_block_ids) == [3, 4, 5, 2, 1, 0]
    assert seq.block_table == [] and seq.num_cached_tokens == 0
    assert bm.used_block_ids == set()
    bm.check_integrity()


def test_can_allocate_refuses_when_pool_too_small():
    bm = BlockManager(3, 4)
    big = make_seq(range(13), 4)        # 4 blocks
    assert bm.can_allocate(big) == -1
    ok = make_seq(range(12), 4)
    assert bm.can_allocate(ok) == 0


def test_shared_prefix_shares_blocks_and_ref_counts():
    bm = BlockManager(10, 4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "a")
    admit(bm, a)
    computed(bm, a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43], 4, "b")
    assert bm.can_allocate(b) == 2
    admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2] == [0, 1]
    assert b.block_table[2] == 3
    assert b.num_cached_tokens == 8 and b.num_prefix_hit_tokens == 8
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    bm.check_integrity()
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 0, 1]
    bm.check_integrity()


def test_shared_blocks_do_not_count_against_free_blocks():
    bm = BlockManager(3, 4)
    a = make_seq(range(8), 4, "a")
    admit(bm, a)
    computed(bm, a)
    b = make_seq(list(range(8)) + [99], 4, "b")   # 2 shared + 1 new; 1 block free
    assert bm.can_allocate(b) == 2
    admit(bm, b)
    assert b.block_table == [0, 1, 2]
    bm.check_integrity()


def test_cached_free_block_is_taken_back_from_free_list():
    bm = BlockManager(6, 4)
    a = make_seq(range(9), 4, "a")
    admit(bm, a)
    computed(bm, a)
    bm.deallocate(a)
    # Block 2 (partial) is plain; blocks 1, 0 still cached, least recently freed first.
    assert list(bm.free_block_ids) == [3, 4, 5, 2, 1, 0]
    again = make_seq(list(range(8)) + [77, 78], 4, "again")
    assert bm.can_allocate(again) == 2
    admit(bm, again)
    assert again.block_table == [0, 1, 3]
    assert list(bm.free_block_ids) == [4, 5, 2]
    assert bm.blocks[0].ref_count == 1 and bm.blocks[0].hash != -1
    bm.check_integrity()


def test_free_cached_hits_count_against_free_blocks():
    bm = BlockManager(4, 4)
    a = make_seq(range(8), 4, "a")
    admit(bm, a)
    computed(bm, a)
    filler = make_seq([50, 51, 52, 53, 54], 4, "f")
    admit(bm, filler)                    # takes 2 and 3
    bm.deallocate(a)                     # 0, 1 free and cached
    b = make_seq(list(range(8)) + [9], 4, "b")   # needs 3 blocks: 2 cached-in-free + 1
    assert bm.can_allocate(b) == -1
    bm.deallocate(filler)
    assert bm.can_allocate(b) == 2


# ---- eviction order ------------------------------------------------------------------------

def test_eviction_prefers_unhashed_then_least_recently_freed():
    bm = BlockManager(8, 2)
    a = make_seq([1, 1, 2, 2, 3], 2, "a")        # blocks 0,1 full; 2 partial
    b = make_seq([5, 5, 6], 2, "b")              # block 3 full; 4 partial
    admit(bm, a)
    admit(bm, b)
    computed(bm, a)
    computed(bm, b)
    bm.deallocate(a)                             # frees 2 (plain), 1, 0 (cached)
    bm.deallocate(b)                             # frees 4 (plain), 3 (cached)
    order = list(bm.free_block_ids)
    assert order == [5, 6, 7, 2, 4, 1, 0, 3]
    # free_block_ids is the allocation order.
    c = make_seq(range(100, 116), 2, "c")
    admit(bm, c)
    assert c.block_table == order
    assert bm.hash_to_block_id == {}             # every cached block got evicted
    bm.check_integrity()


def test_allocation_destroys_cache_entry_of_reused_block():
    bm = BlockManager(2, 2)
    a = make_seq([7, 8, 9], 2, "a")
    admit(bm, a)
    computed(bm, a)
    h = bm.blocks[0].hash
    bm.deallocate(a)
    assert bm.hash_to_block_id == {h: 0}
    b = make_seq([1, 2, 3], 2, "b")
    admit(bm, b)                                  # takes 1 (plain) then 0 (cached)
    assert b.block_table == [1, 0]
    assert bm.hash_to_block_id == {}
    assert bm.blocks[0].hash == -1
    bm.check_integrity()


def test_stale_entry_is_dropped_only_if_it_points_at_the_block():
    bm = BlockManager(6, 2)
    a = make_seq([3, 4, 0], 2, "a")
    b = make_seq([3, 4, 1], 2, "b")
    admit(bm, a)
    admit(bm, b)                                 # same first block, both allocated fresh
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    computed(bm, a)
    computed(bm, b)                              # b's block takes the entry over
    h = bm.blocks[0].hash
    assert bm.blocks[2].hash == h and bm.hash_to_block_id[h] == 2
    bm.deallocate(a)                             # block 0 is unreachable: plain free list
    assert list(bm.free_block_ids)[:4] == [4, 5, 1, 0]
    bm.check_integrity()
    c = make_seq(range(20, 28), 2, "c")
    admit(bm, c)                                 # reuses 4, 5, 1, 0
    assert c.block_table == [4, 5, 1, 0]
    assert bm.hash_to_block_id == {h: 2}         # block 2's entry untouched
    d = make_seq([3, 4], 2, "d")                 # pool is full: only a shared hit fits
    assert bm.can_allocate(d) == 1
    bm.check_integrity()


def test_entry_taken_over_demotes_the_free_previous_holder():
    bm = BlockManager(6, 2)
    a = make_seq([3, 4, 0], 2, "a")
    admit(bm, a)
    computed(bm, a)
    h = bm.blocks[0].hash
    bm.deallocate(a)                             # 0 cached and free, 1 plain
    b = make_seq([3, 4, 1], 2, "b")
    assert bm.can_allocate(b) == 1
    bm.allocate(b, 0)                            # the caller may decline the hit
    assert b.block_table == [2, 3]
    computed(bm, b)
    assert bm.hash_to_block_id == {h: 2}
    assert bm.blocks[0].hash == -1               # previous holder demoted to the plain list
    assert list(bm.free_block_ids) == [4, 5, 1, 0]
    bm.check_integrity()


# ---- hash collisions -----------------------------------------------------------------------

def test_hash_collision_is_rejected_by_token_comparison(monkeypatch):
    monkeypatch.setattr(BlockManager, "compute_hash", classmethod(lambda cls, t, p=-1: 12345))
    bm = BlockManager(8, 2)
    a = make_seq([1, 2, 3], 2, "a")
    admit(bm, a)
    computed(bm, a)
    assert bm.hash_to_block_id == {12345: 0}
    b = make_seq([9, 9, 3], 2, "b")              # same hash, other tokens
    assert bm.can_allocate(b) == 0
    admit(bm, b)
    assert b.block_table == [2, 3]
    bm.check_integrity()


def test_chained_hash_collision_cannot_splice_another_prefix(monkeypatch):
    monkeypatch.setattr(BlockManager, "compute_hash", classmethod(lambda cls, t, p=-1: 7))
    bm = BlockManager(8, 2)
    a = make_seq([1, 2, 5, 6, 0], 2, "a")
    admit(bm, a)
    computed(bm, a)
    # Second block's tokens match a's second block, but its first block differs: the block
    # was computed after [1, 2], so it must not be handed to a sequence starting [8, 8].
    b = make_seq([8, 8, 5, 6, 0], 2, "b")
    assert bm.can_allocate(b) == 0
    # Two identical blocks in a row must not both map to one physical block.
    c = make_seq([5, 6, 5, 6, 0], 2, "c")
    assert bm.can_allocate(c) <= 1
    admit(bm, c)
    assert len(set(c.block_table)) == len(c.block_table)
    bm.check_integrity()


# ---- decode boundary -----------------------------------------------------------------------

@pytest.mark.parametrize("bs", [1, 2, 16, 256])
def test_append_boundary_rule(bs):
    bm = BlockManager(64, bs)
    prompt = 3 * bs if bs > 1 else 3
    seq = make_seq(range(prompt), bs)
    admit(bm, seq)
    computed(bm, seq)
    seq.token_ids.append(1)                      # the first sampled token, KV not written
    seq.start_decoding()
    grown = []
    for _ in range(2 * bs + 1):
        before = len(seq.block_table)
        need = bm.needs_block(seq)
        assert need == ((len(seq) - 1) % bs == 0)
        assert bm.can_append(seq)
        new = bm.may_append(seq)
        assert (new != -1) == need
        assert len(seq.block_table) == before + need
        # After scheduling, the block table covers every token including the last one.
        assert len(seq.block_table) == -(-len(seq) // bs)
        grown.append(need)
        seq.token_ids.append(2)
        bm.hash_blocks(seq)
        bm.check_integrity()
    assert sum(grown) == sum((n - 1) % bs == 0 for n in range(prompt + 1, prompt + 2 * bs + 2))
    if bs == 1:
        assert all(grown)


def test_can_append_needs_free_block_only_on_boundary():
    bm = BlockManager(2, 4)
    seq = make_seq(range(8), 4)
    admit(bm, seq)
    computed(bm, seq)
    seq.token_ids.append(5)                      # len 9: position 8 starts block 2
    seq.start_decoding()
    assert bm.needs_block(seq) and not bm.can_append(seq)
    seq2 = make_seq(range(6), 4, "s2")
    bm2 = BlockManager(2, 4)
    admit(bm2, seq2)
    seq2.token_ids.append(1)                     # len 7: position 6 is inside block 1
    seq2.start_decoding()
    assert not bm2.needs_block(seq2) and bm2.can_append(seq2) and bm2.num_free_blocks == 0
    assert bm2.may_append(seq2) == -1


# ---- reset and integrity -------------------------------------------------------------------

def test_reset_prefix_cache():
    bm = BlockManager(6, 2)
    a = make_seq([1, 2, 3, 4, 5], 2, "a")
    b = make_seq([7, 8, 9], 2, "b")
    admit(bm, a)
    admit(bm, b)
    computed(bm, a)
    computed(bm, b)
    bm.deallocate(a)
    assert len(bm.hash_to_block_id) == 3
    assert bm.reset_prefix_cache() is False      # b's block is in use and still cached
    assert set(bm.hash_to_block_id.values()) == {3}
    assert all(bm.blocks[i].hash == -1 for i in (0, 1, 2))
    bm.check_integrity()
    assert bm.can_allocate(make_seq([1, 2, 3, 4, 5], 2, "x")) == 0
    bm.deallocate(b)
    assert bm.reset_prefix_cache() is True
    assert bm.hash_to_block_id == {}
    bm.check_integrity()


def test_check_integrity_detects_violations():
    def fresh():
        bm = BlockManager(4, 2)
        s = make_seq([1, 2, 3], 2)
        admit(bm, s)
        computed(bm, s)
        bm.check_integrity()
        return bm, s

    bm, s = fresh()
    bm.blocks[0].ref_count = 2
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_integrity()

    bm, s = fresh()
    bm._free_plain.append(0)
    with pytest.raises(AssertionError, match="both free and used"):
        bm.check_integrity()

    bm, s = fresh()
    bm._free_plain.popleft()
    with pytest.raises(AssertionError, match="neither free nor used"):
        bm.check_integrity()

    bm, s = fresh()
    bm.hash_to_block_id[42] = 1
    with pytest.raises(AssertionError, match="hash entry 42"):
        bm.check_integrity()

    bm, s = fresh()
    s.block_table.append(3)                       # a table holding a block behind the pool's back
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_block_reset_and_repr():
    b = Block(3)
    assert (b.ref_count, b.hash, b.token_ids) == (0, -1, [])
    b.update(99, [1, 2], -1)
    b.reset(5)
    assert (b.ref_count, b.hash, b.token_ids, b.serial) == (1, -1, [], 5)
    assert "id=3" in repr(b)
