"""The BlockManager's invariants, checked (BlockManager.check_integrity; its docstring states them).

Walks the whole pool: meant for tests and debugging, not for every step.
"""
from __future__ import annotations

from tpserve.kv_groups import max_window_blocks, window_start


def check_integrity(manager) -> None:
    """Raise AssertionError describing the first violated invariant of BlockManager ``manager``."""
    n = manager.num_blocks
    plain, cached = list(manager._free.plain), list(manager._free.cached)
    free = plain + cached
    assert len(free) == len(set(free)), f"a block is twice in the free list: {free}"
    free_set = set(free)
    overlap = free_set & manager.used_block_ids
    assert not overlap, f"blocks both free and used: {sorted(overlap)}"
    missing = set(range(n)) - free_set - manager.used_block_ids
    assert not missing, f"blocks neither free nor used: {sorted(missing)}"
    assert len(free_set) + len(manager.used_block_ids) == n, "free + used != num_blocks"

    expected = [0] * n
    bs = manager.block_size
    for seq in manager._live:
        tables = manager.tables(seq)
        assert all(len(t) == len(tables[0]) for t in tables), f"{seq!r}: tables of unequal length"
        held = [b for t in tables for b in t if b != -1]
        assert len(held) == len(set(held)), f"{seq!r} holds a block twice: {tables}"
        for g, table in enumerate(tables):
            group = manager.groups[g]
            for block_id in table:
                if block_id != -1:
                    expected[block_id] += 1
                    assert manager.blocks[block_id].group == g, \
                        f"{seq!r}: block {block_id} of group {manager.blocks[block_id].group} in group {g}"
            if not group.sliding:
                assert -1 not in table, f"{seq!r}: full-attention group {g} misses a block: {table}"
                continue
            q, w = seq.num_cached_tokens, group.window
            start = window_start(w, q, bs)
            assert all(b == -1 for b in table[:start]), \
                f"{seq!r}: group {g} holds blocks before its window (next query {q}): {table}"
            read_from = max(0, q - w + 1) // bs
            assert -1 not in table[read_from:], \
                f"{seq!r}: group {g} misses a block its next query (at {q}) reads: {table}"
            if len(table) <= q // bs + 1:  # decoding: the table ends at the next query's block
                num_held = len(table) - table.count(-1)
                assert num_held <= max_window_blocks(w, bs), \
                    f"{seq!r}: group {g} holds {num_held} blocks for window {w}"
    for block in manager.blocks:
        b = block.block_id
        assert block.ref_count == expected[b], (
            f"block {b}: ref_count {block.ref_count} but {expected[b]} live block tables hold it")
        if b in free_set:
            assert block.ref_count == 0, f"free block {b} has ref_count {block.ref_count}"
        else:
            assert block.ref_count > 0, f"used block {b} has ref_count 0"

    for g, index in enumerate(manager.group_hashes):
        for h, b in index.items():
            assert 0 <= b < n, f"hash entry {h} points at invalid block {b}"
            assert manager.blocks[b].hash == h, (
                f"hash entry {h} points at block {b} whose hash is {manager.blocks[b].hash}")
            assert manager.blocks[b].group == g, \
                f"group {g}'s hash entry {h} points at block {b} of group {manager.blocks[b].group}"
            assert len(manager.blocks[b].token_ids) == manager.block_size, \
                f"hashed block {b} is not full"
    for b in cached:
        h = manager.blocks[b].hash
        assert h != -1 and manager.group_hashes[manager.blocks[b].group].get(h) == b, \
            f"block {b} is in the cached free list but not reachable from the cache"
    for b in plain:
        h = manager.blocks[b].hash
        assert h == -1 or manager.group_hashes[manager.blocks[b].group].get(h) != b, \
            f"block {b} is reachable from the cache but in the plain free list"
