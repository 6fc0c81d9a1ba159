"""BlockManager: the pool of KV-cache blocks, their ref counts and the chained-hash prefix cache.

The manager is the sole owner of block state. It works on any object shaped like a scheduler
``Sequence`` (``token_ids``, ``block(i)``, ``block_size``, ``block_table``, ``num_cached_tokens``,
``num_prefix_hit_tokens``, ``num_hashed_blocks``, ``block_hashes``); it never imports the
scheduler. Block hashes and their memo are in ``prefix_hash``; the events it records for
routers (``kv_events``, when a sink is attached) in ``kv_events``; what several KV-cache groups
(sliding-window layers) add, in ``group_tables``; the invariants' check, in ``integrity``.
"""
from __future__ import annotations

from collections import deque

from tpserve.blockpool.block import Block
from tpserve.blockpool.free_blocks import FreeBlocks
from tpserve.blockpool.group_tables import LOAD, GroupTables, _GroupState
from tpserve.blockpool.integrity import check_integrity
from tpserve.blockpool.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventSink
from tpserve.blockpool.prefix_hash import block_hashes, chain_hash
from tpserve.kv_groups import KVCacheGroup

__all__ = ["LOAD", "BlockManager"]


class BlockManager(GroupTables):
    """A fixed pool of ``num_blocks`` blocks of ``block_size`` tokens.

    Invariants (checked by :meth:`check_integrity`):

    - ``free_block_ids`` and ``used_block_ids`` partition ``range(num_blocks)``.
    - ``blocks[b].ref_count`` equals the number of live block tables holding ``b``; free blocks
      have ref_count 0, used blocks at least 1. The manager tracks the live sequences itself:
      a sequence is live from :meth:`allocate` until :meth:`deallocate`.
    - ``hash_to_block_id[h] == b`` implies ``blocks[b].hash == h``. Only full blocks whose KV
      has been written are hashed (:meth:`hash_blocks`); freeing a block keeps its entry, so a
      preempted or finished sequence can find its blocks again until they are reused.

    Eviction order (``free_block_ids``, exactly the allocation order) is FreeBlocks': free
    blocks without a reachable hash first, in the order freed, then cached free blocks, least
    recently freed first. A cache hit on a free block takes it back out of the free list
    (whatever its position); a hit on a used block shares it (ref_count += 1).

    A cache hit compares the block's token ids and the identity (serial) of the block before
    it, so even a collision of the chained hash can never hand out a block with other KV.

    ``deallocate`` walks a block table in reverse, so a sequence's tail blocks are freed before
    its head: among equally old cached blocks the tail (least likely to be shared) goes first.

    With ``kv_events`` set to a KVEventSink, every key that enters or leaves
    ``hash_to_block_id`` is recorded there (kv_events.py); None (the default) records nothing.

    KV tiers (tpserve/kv_tiers): with ``offload`` set (the tiers' scheduler side), a cached
    block handed out fresh, the only moment a full, hashed block's KV is lost, is first
    reported to ``offload.on_evict`` with its hash, parent hash and tokens; the tiers save its
    KV before the step that overwrites it. Blocks a tier is loading into belong to one
    sequence (ref_count 1, no hash until the load is done): they are used, never free, so no
    allocation can evict them (checked by the tiers' check_integrity). With groups, each group's
    blocks are saved and loaded apart (``on_evict`` names the group), and :meth:`tiered_hits`
    plans a hit that takes every group's needed blocks from this pool or from the tiers.

    KV-cache groups (``groups``, kv_groups.py): the layers of one attention type share one block
    table per sequence; all groups draw on this one pool. Group 0's table is
    ``seq.block_table``; the others' are :meth:`tables`. Every table of a sequence has one entry
    per block of the sequence (index-aligned), so the seed's rules hold per group: allocation
    gives each group a block per block of the sequence, a decode step on a block boundary takes
    one block per group (``can_append`` needs as many free), ``deallocate`` walks each table in
    reverse, and each group has its own prefix-cache index (``group_hashes[g]``;
    ``hash_to_block_id`` is group 0's) keyed by the same chained hashes. With more groups:

    - A block belongs to one group at a time (``blocks[b].group``, set when handed out fresh);
      ``group_hashes[g][h] == b`` implies ``blocks[b].group == g`` as well as the hash.
    - A sliding group (window W) holds no block wholly before ``window_start(W, q)`` where q is
      the sequence's next query position (``num_cached_tokens``): :meth:`slide_windows`, called
      whenever q advances (``hash_blocks`` does it after hashing), frees them and sets their
      entries to -1; a freed block keeps its cache entry like any freed block. Every entry a
      query can still read (index >= (q - W + 1) // block_size) is a real block. A decoding
      sequence therefore holds at most ``ceil(W / block_size) + 1`` blocks of the group.
    - A prefix-cache hit of k blocks is usable only where every group holds what the next query
      reads: each full group its blocks 0 .. k-1 (the seed's serial chain), each sliding group
      the blocks from ``window_start(W, k * block_size)`` to k-1, a chain of consecutive hits
      whose first block's parent hash is the chained hash before it. k is the largest length
      that every group accepts (``group_hits``); the sliding group's earlier entries are -1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 groups: list[KVCacheGroup] | None = None):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.groups: list[KVCacheGroup] = list(groups) if groups else [KVCacheGroup()]
        # True unless the seed's single full-attention table is all there is.
        self.grouped = len(self.groups) > 1 or self.groups[0].sliding
        self.group_hashes: list[dict[int, int]] = [self.hash_to_block_id] + [{} for _ in self.groups[1:]]
        self.used_block_ids: set[int] = set()
        self._free = FreeBlocks(num_blocks)  # in eviction order, see free_blocks.py
        self._free_plain = self._free.plain  # the plain class, for tests that corrupt it on purpose
        # Live sequences (allocated, not yet deallocated), keyed by identity; grouped, each maps
        # to its _GroupState (the tables of groups 1.., the sliding groups' first held entries).
        self._live: dict[object, _GroupState | None] = {}
        self._next_serial = 0
        self.kv_events: KVEventSink | None = None
        self.offload = None  # the KV tiers' scheduler side (on_evict), or None

    # ---- views ---------------------------------------------------------------------------
    @property
    def free_block_ids(self) -> deque[int]:
        """Free block ids in the order they will be allocated (a fresh copy: O(num_free))."""
        return self._free.order()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.used_block_ids)

    def live_sequences(self) -> list:
        """Sequences holding blocks: allocated and not yet deallocated."""
        return list(self._live)

    def tables(self, seq) -> list[list[int]]:
        """The block tables of a live ``seq``, one per group (group 0's is ``seq.block_table``);
        -1 marks an entry a sliding group no longer holds."""
        state = self._live.get(seq)
        return [seq.block_table, *state.tables] if state is not None else [seq.block_table]

    @property
    def blocks_per_append(self) -> int:
        """Blocks one decode step on a block boundary takes: one per group."""
        return len(self.groups)

    def _removed(self, hashes: list[int], group: int) -> BlockRemoved:
        g = self.groups[group]
        return BlockRemoved(hashes, "GPU", group, g.kind, g.window)

    # ---- hashing -------------------------------------------------------------------------
    @classmethod
    def compute_hash(cls, token_ids: list[int], prefix: int = -1) -> int:
        """The chained block hash (prefix_hash.chain_hash); a seam tests replace to force collisions."""
        return chain_hash(token_ids, prefix)

    def _lookup(self, seq, i: int, parent_serial: int) -> int:
        """The cached block holding full block ``i`` of ``seq`` after the given parent, or -1."""
        block_id = self.hash_to_block_id.get(block_hashes(seq, i + 1, self.compute_hash)[i], -1)
        if block_id == -1:
            return -1
        block = self.blocks[block_id]
        if block.parent_serial != parent_serial or block.token_ids != seq.block(i):
            return -1
        return block_id

    # ---- allocation ----------------------------------------------------------------------
    def _allocate_block(self, group: int = 0) -> int:
        """Take the next free block for fresh contents of ``group``, dropping its (stale) cache
        entry."""
        block_id = self._free.pop()
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has ref_count {block.ref_count}"
        index = self.group_hashes[block.group]
        if block.hash != -1 and index.get(block.hash) == block_id:
            del index[block.hash]
            if self.kv_events is not None:
                self.kv_events.add(self._removed([block.hash], block.group))
            if self.offload is not None:
                self.offload.on_evict(block_id, block.hash, block.parent_hash, block.token_ids,
                                      block.group)
        block.reset(self._next_serial, group)
        self._next_serial += 1
        self.used_block_ids.add(block_id)
        return block_id

    def _take_cached_block(self, block_id: int) -> None:
        """Take a cached block back out of the free list, keeping its contents and hash."""
        self._free.take_cached(block_id)
        self.blocks[block_id].ref_count = 1
        self.used_block_ids.add(block_id)

    def _deallocate_block(self, block_id: int, evict_first: bool = False) -> None:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        self.used_block_ids.remove(block_id)
        cached = block.hash != -1 and self.group_hashes[block.group].get(block.hash) == block_id
        self._free.push(block_id, cached=cached, evict_first=evict_first)

    def prefix_hits(self, seq, use_cache: bool = True) -> list[int]:
        """The cached blocks holding ``seq``'s leading full blocks, in order (the prefix-cache
        hit an admission would get); [] without the cache or with ``use_cache`` False."""
        hits: list[int] = []
        if self.enable_prefix_caching and use_cache:
            parent_serial = -1
            for i in range(len(seq.token_ids) // self.block_size):
                block_id = self._lookup(seq, i, parent_serial)
                if block_id == -1:
                    break
                hits.append(block_id)
                parent_serial = self.blocks[block_id].serial
        return hits

    def can_allocate(self, seq, use_cache: bool = True) -> int:
        """Number of leading blocks of ``seq`` found in the prefix cache, or -1 if the free
        blocks cannot hold the rest. Cached blocks in use are shared and cost nothing; cached
        blocks sitting in the free list are taken back and so count against the free blocks.
        ``use_cache`` False looks nothing up (the sequence computes every token)."""
        if self.grouped:
            k, hits = self.group_hits(seq, use_cache)
            return k if self.num_free_blocks >= self.grouped_cost(seq, k, hits) else -1
        hits = self.prefix_hits(seq, use_cache)
        num_new_blocks = seq.num_blocks - sum(1 for b in hits if self.blocks[b].ref_count > 0)
        if self.num_free_blocks < num_new_blocks:
            return -1
        return len(hits)

    def allocate(self, seq, num_cached_blocks: int, hits: list[list[int]] | None = None) -> None:
        """Give ``seq`` blocks for all its tokens; the first ``num_cached_blocks`` come from the
        prefix cache (as reported by :meth:`can_allocate`). Sets ``num_cached_tokens``.
        ``hits``: with groups, :meth:`tiered_hits`' plan (``num_cached_blocks`` its length)."""
        assert not seq.block_table, "allocate() on a sequence that already holds blocks"
        assert seq.block_size == self.block_size, "sequence and pool disagree on the block size"
        if self.grouped:
            return self._allocate_grouped(seq, num_cached_blocks, hits)
        bs = self.block_size
        table = seq.block_table
        parent_serial = -1
        for i in range(num_cached_blocks):
            block_id = self._lookup(seq, i, parent_serial)
            assert block_id != -1, f"cached block {i} vanished between can_allocate and allocate"
            block = self.blocks[block_id]
            if block.ref_count > 0:
                block.ref_count += 1
            else:
                self._take_cached_block(block_id)
            table.append(block_id)
            parent_serial = block.serial
        for _ in range(num_cached_blocks, seq.num_blocks):
            table.append(self._allocate_block())
        seq.num_cached_tokens = num_cached_blocks * bs
        seq.num_prefix_hit_tokens = num_cached_blocks * bs
        seq.num_hashed_blocks = num_cached_blocks
        self._live[seq] = None

    def deallocate(self, seq) -> None:
        """Release every block of ``seq`` (tail first); hash entries stay for later hits.

        A pooling request's blocks (``seq.pooling``, --runner pooling) stay in the prefix cache
        but are evicted before any other cached block, unless its admission found them there
        (a prefix shared by requests is worth keeping): one-off texts to embed must not push
        out the prefixes generation reuses."""
        blocks, table = self.blocks, seq.block_table
        shared = seq.num_prefix_hit_tokens // self.block_size if getattr(seq, "pooling", None) else len(table)
        for table in self.tables(seq):
            for block_id in reversed(table[:shared]):
                if block_id == -1:
                    continue
                block = blocks[block_id]
                block.ref_count -= 1
                if block.ref_count == 0:
                    self._deallocate_block(block_id)
            for block_id in table[shared:]:  # each to the front: the tail is evicted before the head
                if block_id == -1:
                    continue
                block = blocks[block_id]
                block.ref_count -= 1
                if block.ref_count == 0:
                    self._deallocate_block(block_id, evict_first=True)
        seq.num_cached_tokens = 0
        seq.num_prefix_hit_tokens = 0
        seq.num_hashed_blocks = 0
        seq.block_table.clear()
        self._live.pop(seq, None)

    # ---- decode ----------------------------------------------------------------------------
    def needs_block(self, seq) -> bool:
        """True when the next decode step writes the first token of a new block.

        ``len(seq)`` includes the just-sampled token whose KV is not yet written, at position
        ``len(seq) - 1``; it starts a block when that position is a multiple of block_size.
        """
        return (len(seq.token_ids) - 1) % self.block_size == 0

    def num_append_blocks(self, seq, num_tokens: int = 1) -> int:
        """Free blocks ``seq`` needs so that the KV of ``num_tokens`` tokens from position
        ``len(seq) - 1`` on has slots (its last token, then ``num_tokens - 1`` draft tokens
        under speculative decoding). For one token: 1 exactly on a block boundary.
        With groups, one block per group for each block of the sequence."""
        if num_tokens == 1:
            return int(self.needs_block(seq)) * len(self.groups)
        end = len(seq.token_ids) - 1 + num_tokens
        return max(0, -(-end // self.block_size) - len(seq.block_table)) * len(self.groups)

    def can_append(self, seq, num_tokens: int = 1) -> bool:
        if num_tokens == 1:
            return self.num_free_blocks >= self.needs_block(seq) * len(self.groups)
        return self.num_free_blocks >= self.num_append_blocks(seq, num_tokens)

    def may_append(self, seq, num_tokens: int = 1) -> int:
        """Give ``seq`` the blocks its next step's ``num_tokens`` tokens need (see
        :meth:`num_append_blocks`; the caller checked :meth:`can_append`). Returns the block
        appended for one token, or -1 if none; with more tokens, the first one appended (the
        rest follow it at the end of the block table), or -1."""
        if num_tokens == 1:
            if (len(seq.token_ids) - 1) % self.block_size:
                return -1
            assert len(seq.block_table) == (len(seq.token_ids) - 1) // self.block_size, \
                "block table out of step with the sequence length"
            block_id = self._allocate_block()
            seq.block_table.append(block_id)
            if self.grouped:
                self._append_others(seq, 1)
            return block_id
        need = self.num_append_blocks(seq, num_tokens)
        assert need <= self.num_free_blocks, "may_append without room: check can_append first"
        need //= len(self.groups)
        first = -1
        for _ in range(need):
            block_id = self._allocate_block()
            seq.block_table.append(block_id)
            first = block_id if first == -1 else first
        if self.grouped:
            self._append_others(seq, need)
        return first

    def truncate(self, seq, num_blocks: int) -> int:
        """Give back the blocks of ``seq`` past its first ``num_blocks``: slots reserved for
        draft tokens that were not accepted. They hold no accepted token's KV, so they are
        neither hashed nor shared; they return to the free list. Returns how many."""
        n = len(seq.block_table) - num_blocks
        for table in self.tables(seq):
            for _ in range(n):
                block_id = table.pop()
                block = self.blocks[block_id]
                assert block.ref_count == 1 and block.hash == -1, \
                    f"block {block_id} past the accepted tokens is shared or hashed"
                block.ref_count = 0
                self._deallocate_block(block_id)
        return max(n, 0)

    def append_blocks(self, seqs) -> list[int]:
        """``may_append`` for sequences that are all on a block boundary, in order; the caller
        has checked that enough blocks are free. Returns the new block ids."""
        assert len(seqs) * len(self.groups) <= self.num_free_blocks
        allocate = self._allocate_block
        new = []
        for seq in seqs:
            block_id = allocate()
            seq.block_table.append(block_id)
            new.append(block_id)
            if self.grouped:
                self._append_others(seq, 1)
        return new

    # ---- prefix cache --------------------------------------------------------------------
    def hash_blocks(self, seq) -> int | None:
        """Enter every full block of ``seq`` whose KV is written (the first
        ``num_cached_tokens // block_size``) into the prefix cache; a no-op when disabled.

        A newer block with the same contents takes the hash entry over; if the previous
        holder is free it loses its hash and becomes first in line for reuse.

        With groups, the blocks that left a sliding window are freed after hashing
        (:meth:`slide_windows`), with the cache enabled or not; returns how many (else None).
        """
        if self.grouped:
            if self.enable_prefix_caching:
                self._hash_grouped(seq)
            return self.slide_windows(seq)
        if not self.enable_prefix_caching:
            return
        self._hash_tables(seq, [seq.block_table], [self.hash_to_block_id])

    def _hash_tables(self, seq, tables, indexes) -> None:
        """Hash the sequence's newly full blocks into each table's blocks and index (one table
        and index per KV-cache group; one without groups), recording what is new to each."""
        num_full = seq.num_cached_tokens // self.block_size
        first = seq.num_hashed_blocks
        if first >= num_full:
            return
        blocks = self.blocks
        hashes = block_hashes(seq, num_full, self.compute_hash)
        state = self._live.get(seq)
        for g, (table, index) in enumerate(zip(tables, indexes)):
            new = [] if self.kv_events is not None else None  # block indices new to the cache
            held = state.firsts[g] if state is not None else 0  # entries before it: none (sliding)
            for i in range(first, num_full):
                h, block_id = hashes[i], table[i]
                if i < held and block_id == -1:
                    continue  # allocated past a window (a hit loaded from the KV tiers)
                assert block_id != -1, f"group {g}: block {i} left the window before it was hashed"
                if blocks[block_id].hash == h:
                    continue  # a cached block of the hit, after blocks loaded from the tiers
                prev = table[i - 1] if i else -1
                blocks[block_id].update(h, seq.block(i), blocks[prev].serial if prev != -1 else -1,
                                        hashes[i - 1] if i else -1)
                old = index.get(h, -1)
                if old != -1 and old != block_id and self._free.is_cached(old):
                    self._free.uncache(old)
                    blocks[old].hash = -1
                elif old == -1 and new is not None:
                    new.append(i)
                index[h] = block_id
            if new:
                self._record_stored(seq, hashes, new, g)
        seq.num_hashed_blocks = num_full

    def _record_stored(self, seq, hashes: list[int], new: list[int], group: int = 0) -> None:
        """One BlockStored per run of consecutive newly cached blocks of ``seq``."""
        spec = self.groups[group]
        start = 0
        for k in range(1, len(new) + 1):
            if k == len(new) or new[k] != new[k - 1] + 1:
                first, last = new[start], new[k - 1]
                tokens = [t for j in range(first, last + 1) for t in seq.block(j)]
                self.kv_events.add(BlockStored(hashes[first:last + 1], hashes[first - 1] if first else None,
                                               tokens, self.block_size, "GPU", group, spec.kind,
                                               spec.window))
                start = k

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block that is free (e.g. after the weights changed).

        Returns True when the cache is now empty; False when blocks held by live sequences
        are still registered (call again once they are gone).
        """
        dropped: list[list[int]] = [[] for _ in self.groups]
        for block_id in self._free.uncache_all():
            block = self.blocks[block_id]
            del self.group_hashes[block.group][block.hash]
            dropped[block.group].append(block.hash)
            block.hash = -1
        empty = not any(self.group_hashes)
        if self.kv_events is not None and any(dropped):
            if empty:
                self.kv_events.add(AllBlocksCleared())
            else:
                for g, hashes in enumerate(dropped):
                    if hashes:
                        self.kv_events.add(self._removed(hashes, g))
        return empty

    def group_cached_blocks(self) -> list[tuple[int, str, int | None, list]]:
        """(group index, kind, window, :meth:`cached_blocks` of the group) for groups 1..: with
        the group 0 blocks, what a KV-events resync lists."""
        return [(g, group.kind, group.window, self.cached_blocks(g))
                for g, group in enumerate(self.groups) if g]

    def cached_blocks(self, group: int = 0) -> list[tuple[int, int | None, list[int]]]:
        """(hash, parent hash, token ids) of every block in the prefix cache, each block after
        its parent while that is cached: what a router needs to rebuild its view from nothing
        (of KV-cache group ``group``; each group's index is its own).
        The parent is None for a first block only: a block whose parent left the cache still
        names it (its hash is chained from it, and a first block it is not)."""
        blocks, index = self.blocks, self.group_hashes[group]

        def parent(b: int) -> int | None:
            """The hash the hash of block ``b`` was chained from, while that is cached."""
            h = blocks[b].parent_hash
            return h if h in index and index[h] != b else None

        depth: dict[int, int] = {}
        for b in index.values():
            chain, seen = [], set()
            while b not in depth and b not in seen:
                chain.append(b)
                seen.add(b)
                h = parent(b)
                if h is None:
                    break
                b = index[h]
            if not chain:
                continue
            d = depth.get(b, -1) if chain[-1] != b else -1
            for c in reversed(chain):
                d += 1
                depth[c] = d
        return [(blocks[b].hash, None if blocks[b].parent_hash == -1 else blocks[b].parent_hash, blocks[b].token_ids)
                for b in sorted(index.values(), key=depth.__getitem__)]

    # ---- checking ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError describing the first violated invariant (class docstring; with
        sliding groups, meant for between steps: after ``hash_blocks`` / ``slide_windows``)."""
        check_integrity(self)
