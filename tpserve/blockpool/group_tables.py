"""GroupTables: the BlockManager's KV-cache groups (kv_groups.py) — per-group prefix-cache hits,
allocation across groups, and the sliding groups' windows.

A mixin of BlockManager, apart so that the seed's single-table rules read on their own in
block_manager.py; the invariants the groups add are in BlockManager's docstring and checked by
integrity.py. Each method works on the manager's state (``blocks``, ``groups``,
``group_hashes``, ``_live``) through the manager's own allocation primitives
(``_allocate_block``, ``_take_cached_block``, ``_deallocate_block``), so a group's blocks follow
the seed's allocation, ref-count, hash and eviction rules.
"""
from __future__ import annotations

from tpserve.blockpool.prefix_hash import block_hashes
from tpserve.blockpool.sliding_hits import sliding_hit_length
from tpserve.kv_groups import window_start

LOAD = -2  # a hits entry of tiered_hits: a fresh block the KV tiers load


class GroupTables:
    """BlockManager's methods for several KV-cache groups (see BlockManager's docstring)."""

    def group_hits(self, seq, use_cache: bool = True,
                   limit: int | None = None) -> tuple[int, list[list[int]]]:
        """(k, hits): the longest prefix of k full blocks of ``seq`` (at most ``limit``) that every
        group can serve from the prefix cache, and per group the cached block ids of blocks
        0 .. k-1, -1 where a sliding group needs none (before its window). (0, [[], ...])
        without the cache or with ``use_cache`` False."""
        groups, bs = self.groups, self.block_size
        n = len(seq.token_ids) // bs if self.enable_prefix_caching and use_cache else 0
        if limit is not None:
            n = min(n, limit)
        if n == 0:
            return 0, [[] for _ in groups]
        hashes = block_hashes(seq, n, self.compute_hash)
        blocks = self.blocks
        k = n
        found: list[list[int]] = []
        for g, group in enumerate(groups):
            index, ids = self.group_hashes[g], []
            if not group.sliding:  # the seed's leading chain, serial by serial
                parent_serial = -1
                for i in range(k):
                    b = index.get(hashes[i], -1)
                    if b == -1 or blocks[b].parent_serial != parent_serial \
                            or blocks[b].token_ids != seq.block(i):
                        break
                    ids.append(b)
                    parent_serial = blocks[b].serial
                k = len(ids)
            else:  # every cached block (or -1); runs are checked by sliding_hit_length
                ids = self._cached_ids(index, seq, hashes, n)
            found.append(ids)
        sliding = [g for g, group in enumerate(groups) if group.sliding]
        changed = bool(sliding)
        while changed and k:  # each group's answer depends on k: iterate to the fixed point
            changed = False
            for g in sliding:
                k2 = sliding_hit_length(found[g], blocks, k, groups[g].window, bs)
                if k2 < k:
                    k, changed = k2, True
        hits = []
        for g, group in enumerate(groups):
            if group.sliding:
                start = window_start(group.window, k * bs, bs) if k else 0
                hits.append([-1] * start + found[g][start:k])
            else:
                hits.append(found[g][:k])
        return k, hits

    def _cached_ids(self, index: dict, seq, hashes: list[int], n: int) -> list[int]:
        """Per block i < n of ``seq``: the id ``index`` holds for its hash when that block's
        tokens and parent hash match (a hash collision is no hit), else -1."""
        blocks, ids = self.blocks, []
        for i in range(n):
            b = index.get(hashes[i], -1)
            if b != -1 and (blocks[b].token_ids != seq.block(i)
                            or blocks[b].parent_hash != (hashes[i - 1] if i else -1)):
                b = -1
            ids.append(b)
        return ids

    def tiered_hits(self, seq, loadable) -> tuple[int, list[list[int]]]:
        """(e, hits): the longest prefix of e full blocks of ``seq`` that every group can hold
        with blocks of this pool's prefix cache and blocks loaded from the KV tiers
        (``loadable(g, i)``: block i of group g is in a tier). Per group, the blocks its next
        query reads (a full group 0 .. e-1, a sliding group ``window_start(W, e * bs)`` .. e-1)
        are a chain of cached blocks followed by loaded ones: ``hits[g][i]`` is a cached block
        id, LOAD (a fresh block the tiers fill) or -1 (before the window: none). With no
        LOAD entry the answer is :meth:`group_hits`'."""
        groups, bs, blocks = self.groups, self.block_size, self.blocks
        n = len(seq.token_ids) // bs if self.enable_prefix_caching else 0
        if n == 0:
            return 0, [[] for _ in groups]
        hashes = block_hashes(seq, n, self.compute_hash)
        found, ends, loads = [], [], []  # per group: cached ids, end of the cached chain, of loadables
        for g, group in enumerate(groups):
            ids = self._cached_ids(self.group_hashes[g], seq, hashes, n)
            # ends[g][i]: the end of the chain of cached blocks starting at block i (full groups:
            # the leading chain, serial by serial, from block 0 only)
            end = [0] * (n + 1)
            end[n] = n
            for i in range(n - 1, -1, -1):
                b = ids[i]
                if b == -1:
                    end[i] = i
                elif i + 1 < n and ids[i + 1] != -1 and blocks[ids[i + 1]].parent_serial in (
                        (blocks[b].serial,) if not group.sliding else (-1, blocks[b].serial)):
                    end[i] = end[i + 1]
                else:
                    end[i] = i + 1
            if not group.sliding and ids[0] != -1 and blocks[ids[0]].parent_serial != -1:
                end[0] = 0
            # loads[g][i]: the end of the run of loadable blocks starting at block i
            run = [n] * (n + 1)
            for i in range(n - 1, -1, -1):
                run[i] = run[i + 1] if loadable(g, i) else i
            found.append(ids)
            ends.append(end)
            loads.append(run)

        def split(g: int, e: int) -> int:
            """Where group g's loaded blocks start for a hit of e blocks, or -1 if it cannot."""
            group = groups[g]
            s = window_start(group.window, e * bs, bs) if group.sliding else 0
            m = min(ends[g][s], e) if s < e else e
            return m if m == e or loads[g][m] >= e else -1

        for e in range(n, 0, -1):
            cuts = [split(g, e) for g in range(len(groups))]
            if -1 in cuts:
                continue
            hits = []
            for g, group in enumerate(groups):
                s = window_start(group.window, e * bs, bs) if group.sliding else 0
                hits.append([-1] * s + found[g][s:cuts[g]] + [LOAD] * (e - cuts[g]))
            return e, hits
        return 0, [[] for _ in groups]

    def grouped_cost(self, seq, k: int, hits: list[list[int]]) -> int:
        """Free blocks admitting ``seq`` with the hits of :meth:`group_hits` (or
        :meth:`tiered_hits`: a LOAD entry takes a fresh block) takes."""
        n, blocks = seq.num_blocks, self.blocks
        need = 0
        for ids in hits:
            nulls = sum(1 for b in ids if b == -1)
            need += n - nulls - sum(1 for b in ids if b >= 0 and blocks[b].ref_count > 0)
        return need

    def _allocate_grouped(self, seq, num_cached_blocks: int, hits: list[list[int]] | None = None) -> None:
        if hits is None:
            k, hits = self.group_hits(seq, True, num_cached_blocks)
            assert k == num_cached_blocks, f"cached blocks changed between can_allocate and allocate: {k}"
        k = num_cached_blocks
        assert all(len(ids) == k for ids in hits), "a group's hits do not cover the cached blocks"
        blocks = self.blocks
        tables: list[list[int]] = [seq.block_table] + [[] for _ in self.groups[1:]]
        for table, ids in zip(tables, hits):  # first take every hit back: none may be evicted
            for block_id in ids:
                if block_id >= 0:
                    if blocks[block_id].ref_count > 0:
                        blocks[block_id].ref_count += 1
                    else:
                        self._take_cached_block(block_id)
                table.append(block_id)
        for g, table in enumerate(tables):
            for i, block_id in enumerate(table):
                if block_id == LOAD:
                    table[i] = self._allocate_block(g)
            for _ in range(k, seq.num_blocks):
                table.append(self._allocate_block(g))
        bs = self.block_size
        # Blocks to load count as written (so the windows hold what the next query reads) but
        # are hashed only once the load is done (hash_blocks then skips the cached ones).
        first_load = min((ids.index(LOAD) for ids in hits if LOAD in ids), default=k)
        seq.num_cached_tokens = k * bs
        seq.num_prefix_hit_tokens = first_load * bs
        seq.num_hashed_blocks = first_load
        firsts = [sum(1 for b in ids if b == -1) for ids in hits]
        self._live[seq] = _GroupState(tables[1:], firsts)

    def slide_windows(self, seq, next_pos: int | None = None) -> int:
        """Free the blocks of ``seq``'s sliding groups wholly before the window of its next
        query (at ``next_pos``, by default ``num_cached_tokens``); their entries become -1.
        Returns how many entries were dropped. Nothing to do without sliding groups."""
        state = self._live.get(seq)
        if state is None:
            return 0
        q = seq.num_cached_tokens if next_pos is None else next_pos
        bs, blocks, dropped = self.block_size, self.blocks, 0
        for g, group in enumerate(self.groups):
            if not group.sliding:
                continue
            table = seq.block_table if g == 0 else state.tables[g - 1]
            end = min(window_start(group.window, q, bs), len(table))
            for i in range(state.firsts[g], end):
                block_id = table[i]
                if block_id != -1:
                    table[i] = -1
                    block = blocks[block_id]
                    block.ref_count -= 1
                    if block.ref_count == 0:
                        self._deallocate_block(block_id)
                    dropped += 1
            state.firsts[g] = max(state.firsts[g], end)
        return dropped

    def _append_others(self, seq, n: int) -> None:
        """Give each group but group 0 ``n`` more blocks (group 0's already appended)."""
        state = self._live[seq]
        for g, table in enumerate(state.tables, 1):
            for _ in range(n):
                table.append(self._allocate_block(g))

    def _hash_grouped(self, seq) -> None:
        """``hash_blocks`` in every group's table and index."""
        self._hash_tables(seq, self.tables(seq), self.group_hashes)


class _GroupState:
    """A live sequence's tables of groups 1.. and, per group, the first entry still held."""

    __slots__ = ("tables", "firsts")

    def __init__(self, tables: list[list[int]], firsts: list[int]):
        self.tables = tables
        self.firsts = firsts
